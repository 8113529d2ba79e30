"""Samples, how they are generated, weights to the samplers."""
