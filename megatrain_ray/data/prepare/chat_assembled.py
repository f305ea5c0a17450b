"""Chat templates of the ChatML family rendered without Jinja: a conversation as the concatenation of one piece
per message, exactly the string the template renders, recognised from the template's syntax tree.

A template is recognised (`assembled_template`) only where its Jinja syntax tree, parsed with the settings of
transformers' environment (trim_blocks, lstrip_blocks), is exactly this shape, whatever its spacing:

    {% for M in messages %}
      [{% if loop.first and messages[0]['role'] != 'system' %}{{ SYSTEM }}{% endif %}]
      {{ T1 + T2 + ... }}                          T: a string literal, M['role'] or M['content'] (or M.role, ...)
    {% endfor %}
    {% if add_generation_prompt %}{{ PROMPT }}{% endif %}

(SmolLM2's template, with its default system message SYSTEM, and plain ChatML are of it). For a conversation
whose every message is a dict with a str role and content (what records.to_messages gives), such a template
renders message k as the concatenation of its terms (`+` of str is concatenation, `M['role']` of a dict its
item, and `M.role` too: neither name is an attribute of a dict), the first message preceded by SYSTEM when its
role is not system; the generation prompt is PROMPT at the end. So the render of messages[:k] is the first k
pieces joined, which is what spans need. Anything else, a message with a role or content of another type
included, is rendered by Jinja as before (chat_render.ChatRenderer): this is an exact shortcut, never an
approximation. Jinja's extensions in transformers' environment only add tags (generation, break, continue): a
template using one does not parse here and is left to Jinja.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# A term of a message's piece: ("text", literal) or ("key", "role" | "content").
Term = tuple[str, str]


@dataclass(frozen=True, slots=True)
class AssembledTemplate:
    system: str | None
    """Rendered before the first message when its role is not system (None: the template has no such block)."""
    terms: tuple[Term, ...]
    prompt: str
    """The generation prompt (add_generation_prompt)."""

    def pieces(self, messages: list[Any]) -> list[str] | None:
        """Each message's part of the render, in order; None where a message is not a dict with a str role and
        content (the template must then be rendered by Jinja, which decides what such a message gives)."""
        for message in messages:
            if not (type(message) is dict and type(message.get("role")) is str
                    and type(message.get("content")) is str):
                return None
        terms = self.terms
        pieces = ["".join(value if kind == "text" else message[value] for kind, value in terms)
                  for message in messages]
        if pieces and self.system is not None and messages[0]["role"] != "system":
            pieces[0] = self.system + pieces[0]
        return pieces


@lru_cache(maxsize=8)
def assembled_template(template: str | None) -> AssembledTemplate | None:
    """The template as an AssembledTemplate where its syntax tree is of the recognised shape, else None."""
    if not isinstance(template, str):
        return None
    try:
        import jinja2
        from jinja2 import nodes
    except ImportError:
        return None
    try:
        tree = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).parse(template)
    except Exception:  # a syntax (or extension tag) this environment does not know: Jinja decides
        return None
    return _match(tree, nodes)


def _match(tree: Any, nodes: Any) -> AssembledTemplate | None:
    body = tree.body
    if len(body) != 2 or not isinstance(body[0], nodes.For) or not isinstance(body[1], nodes.If):
        return None
    loop, generation = body
    if not (isinstance(loop.target, nodes.Name) and _is_name(loop.iter, "messages", nodes) and not loop.else_
            and loop.test is None and not loop.recursive):
        return None
    var = loop.target.name
    if var in ("messages", "loop"):
        return None
    inner = list(loop.body)
    system = None
    if len(inner) == 2:
        system = _system_block(inner[0], nodes)
        if system is None:
            return None
        inner = inner[1:]
    if len(inner) != 1 or not isinstance(inner[0], nodes.Output):
        return None
    terms: list[Term] = []
    for node in inner[0].nodes:
        if not _terms(node, var, terms, nodes):
            return None
    if not (_is_name(generation.test, "add_generation_prompt", nodes) and not generation.elif_
            and not generation.else_):
        return None
    prompt = _constant_output(generation.body, nodes)
    if prompt is None:
        return None
    return AssembledTemplate(system, _merged(terms), prompt)


def _is_name(node: Any, name: str, nodes: Any) -> bool:
    return isinstance(node, nodes.Name) and node.name == name and node.ctx == "load"


def _key(node: Any, owner: Any, nodes: Any) -> str | None:
    """'role' or 'content' where node is owner['role'] / owner.role (and so on); else None."""
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.ctx == "load":
        key = node.arg.value
    elif isinstance(node, nodes.Getattr) and node.ctx == "load":
        key = node.attr
    else:
        return None
    if type(key) is not str or key not in ("role", "content") or not owner(node.node):
        return None
    return key


def _system_block(node: Any, nodes: Any) -> str | None:
    """SYSTEM of `{% if loop.first and messages[0]['role'] != 'system' %}{{ SYSTEM }}{% endif %}`, else None."""
    if not (isinstance(node, nodes.If) and not node.elif_ and not node.else_):
        return None
    test = node.test
    if not (isinstance(test, nodes.And) and isinstance(test.left, nodes.Getattr) and test.left.attr == "first"
            and _is_name(test.left.node, "loop", nodes) and isinstance(test.right, nodes.Compare)):
        return None
    compare = test.right

    def first_message(n: Any) -> bool:
        return (isinstance(n, nodes.Getitem) and _is_name(n.node, "messages", nodes)
                and isinstance(n.arg, nodes.Const) and type(n.arg.value) is int and n.arg.value == 0)
    if not (_key(compare.expr, first_message, nodes) == "role" and len(compare.ops) == 1
            and compare.ops[0].op == "ne" and isinstance(compare.ops[0].expr, nodes.Const)
            and compare.ops[0].expr.value == "system" and type(compare.ops[0].expr.value) is str):
        return None
    return _constant_output(node.body, nodes)


def _constant_output(body: list, nodes: Any) -> str | None:
    """The text of a body that is one output of string literals (or template text) only; else None."""
    if len(body) != 1 or not isinstance(body[0], nodes.Output):
        return None
    parts = []
    for node in body[0].nodes:
        if isinstance(node, nodes.TemplateData):
            parts.append(node.data)
        elif isinstance(node, nodes.Const) and type(node.value) is str:
            parts.append(node.value)
        else:
            return None
    return "".join(parts)


def _terms(node: Any, var: str, out: list[Term], nodes: Any) -> bool:
    """Appends the terms of a `+` chain of string literals and var['role'] / var['content']; False if it is not one."""
    if isinstance(node, nodes.Add):
        return _terms(node.left, var, out, nodes) and _terms(node.right, var, out, nodes)
    if isinstance(node, nodes.TemplateData):
        out.append(("text", node.data))
        return True
    if isinstance(node, nodes.Const):
        if type(node.value) is not str:
            return False
        out.append(("text", node.value))
        return True
    key = _key(node, lambda n: _is_name(n, var, nodes), nodes)
    if key is None:
        return False
    out.append(("key", key))
    return True


def _merged(terms: list[Term]) -> tuple[Term, ...]:
    """Adjacent literals joined into one."""
    merged: list[Term] = []
    for kind, value in terms:
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return tuple(merged)
