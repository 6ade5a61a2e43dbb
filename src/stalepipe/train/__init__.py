"""stalepipe.train"""
