"""stalepipe.experiments"""
