"""stalepipe.training.train"""
