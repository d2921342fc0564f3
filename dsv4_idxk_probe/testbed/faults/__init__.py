"""Faults for the test beds: the spec (`spec`), where and how bytes are changed
(`inject`), what the probe should then report (`expect`, `verify`), and the
neutral room plan (`plan`) both beds hand to it. See docs/faults.md.
"""
