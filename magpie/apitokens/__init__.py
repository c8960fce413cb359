"""API tokens for programs: workspace- and role-scoped bearer tokens stored hashed in PostgreSQL
(:mod:`magpie.apitokens.store`), and a per-token rate limit kept in Redis (:mod:`magpie.apitokens.ratelimit`)."""
