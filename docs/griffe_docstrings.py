"""A Griffe extension for the API reference (loaded by mkdocstrings, see
``mkdocs.yml``): reads the package's Keras-style docstrings as Markdown.

* An ``Example:`` heading (Keras' style: singular, with the ``>>>`` lines
  not indented under it) becomes a Google-style ``Examples:`` section with
  the doctest indented under it, so that it renders as code instead of as
  Markdown text;
* an ``Args:`` section that only refers elsewhere (``Args:`` then
  ``See ...``) becomes a paragraph, ``Args: see ...``;
* Sphinx roles (``:class:`X```, ``:func:`X```, ...) become inline code.

The source files are not changed.
"""

import re

import griffe

_HEADING = re.compile(r"^(\s*)Examples?:\s*$")
_ARGS_SEE = re.compile(r"^([ \t]*)Args:[ \t]*\n((?:[ \t]+\S.*(?:\n|$))+)", re.M)
_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|obj|exc|py:\w+):`~?([^`]+)`")


def _indent(line):
    return len(line) - len(line.lstrip())


def _examples(lines):
    out = []
    i = 0
    while i < len(lines):
        match = _HEADING.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        base = len(match.group(1))
        out.append(" " * base + "Examples:")
        i += 1
        block = []
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                # A blank line ends the doctest unless more of it follows.
                j = i
                while j < len(lines) and not lines[j].strip():
                    j += 1
                if j < len(lines) and lines[j].lstrip().startswith(">>>") \
                        and _indent(lines[j]) <= base + 4:
                    block.extend([""] * (j - i))
                    i = j
                    continue
                break
            if block == [] and not line.lstrip().startswith(">>>"):
                break  # not a doctest: leave the section as it is
            block.append(line)
            i += 1
        if block and _indent(block[0]) <= base:
            block = [(" " * 4 + line) if line.strip() else line for line in block]
        out.extend(block)
    return out


def _args_see(match):
    body = match.group(2)
    if not body.lstrip().startswith("See "):
        return match.group(0)
    lines = [line.strip() for line in body.splitlines()]
    lines[0] = "See" + lines[0][3:]
    return match.group(1) + "Constructor arguments: s" + " ".join(lines)[1:] + "\n"


def rewrite(text: str) -> str:
    """The docstring text with the rewrites above."""
    text = "\n".join(_examples(text.split("\n")))
    text = _ARGS_SEE.sub(_args_see, text)
    return _ROLE.sub(r"`\1`", text)


class KerasDocstrings(griffe.Extension):
    """Rewrites every docstring once the object tree is built."""

    def on_object(self, *, obj, loader, **kwargs):  # noqa: ARG002 - griffe's signature
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
