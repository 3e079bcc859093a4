"""The test suite as a package.

With this file pytest puts the repository root (not ``tests/``) on ``sys.path`` for the
test packages under it, so ``tests/api`` is ``tests.api`` and can never stand in for the
service's own ``api`` package (nor ``tests/worker`` for ``worker``): every test imports the
code of the tree it runs in.
"""
