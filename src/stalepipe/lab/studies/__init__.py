"""The studies: named grids over the sweep axes, their scales and the claims they test."""
