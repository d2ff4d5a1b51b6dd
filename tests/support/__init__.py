"""Helpers shared by the tests: paths, scripted fakes. Not tests themselves."""
