"""Code the tests share: the stack and service processes, fixtures, fakes, model builders (tests/README.md)."""
