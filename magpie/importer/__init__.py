"""Importing proxy lists: parsing published list formats into routes."""
