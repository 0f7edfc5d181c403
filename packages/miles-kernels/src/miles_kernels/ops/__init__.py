"""Batch-invariant ops (deterministic mode) and their plain-torch counterparts (fast mode).

Every op here takes a `KernelConfig`; in deterministic mode a token's result is bitwise independent of
which other tokens share the call. docs/true-on-policy.md lists each source of variance and its fix.
"""
