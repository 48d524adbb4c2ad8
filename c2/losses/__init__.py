"""Losses shared by every phase: the LM objective, fused head losses, targets, MoE balance terms."""
