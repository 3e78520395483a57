"""daskpipe.dashboard"""
