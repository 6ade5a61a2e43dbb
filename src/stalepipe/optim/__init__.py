"""stalepipe.optim"""
