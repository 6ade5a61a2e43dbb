"""stalepipe.pipeline"""
