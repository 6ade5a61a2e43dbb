"""stalepipe.data"""
