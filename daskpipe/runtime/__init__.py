"""daskpipe.runtime"""
