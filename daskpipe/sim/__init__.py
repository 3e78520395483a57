"""daskpipe.sim"""
