"""Route enrichment: country and ASN from MaxMind-format files, abuse reputation, bounded caches."""
