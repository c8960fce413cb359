"""Operator-managed blacklists of addresses and CIDR ranges, and what a listed route becomes per workspace."""
