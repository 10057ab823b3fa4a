"""Shapes world."""
