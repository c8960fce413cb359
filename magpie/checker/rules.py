"""Valid-answer rules: what a judge's HTTP 200 answer must be for a check to count as alive.

* ``echo`` (default): a judge echo, a JSON object with ``remote_addr`` and ``headers`` (anonymity graded);
* ``status``: any body; HTTP 200 is enough;
* ``contains:<text>``: the body contains ``<text>`` (UTF-8).

With ``status`` and ``contains`` the body is still read as an echo when it is one, so anonymity is graded
where the judge allows it.
"""

from __future__ import annotations

DEFAULT_RULE = "echo"
MAX_NEEDLE = 200


def validate_rule(rule: str) -> str:
    """``rule`` as stored, or raises ``ValueError`` naming what is wrong (one line)."""
    rule = (rule or "").strip()
    if rule in ("echo", "status"):
        return rule
    if rule.startswith("contains:"):
        needle = rule[len("contains:"):]
        if not needle:
            raise ValueError("rule 'contains:' needs the text to look for, e.g. contains:origin")
        if len(needle) > MAX_NEEDLE:
            raise ValueError(f"rule text longer than {MAX_NEEDLE} characters")
        return rule
    raise ValueError(f"unknown rule {rule!r}: expected echo, status or contains:<text>")


def needle_of(rule: str) -> bytes | None:
    """The bytes a ``contains:`` rule looks for (None for the other rules)."""
    return rule[len("contains:"):].encode() if rule.startswith("contains:") else None
