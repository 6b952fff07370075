"""Whether a chat template's tools shape only its head, so that a bridge renders the same without them.

A bridge (``tokenization.renderer``) is cut from a render of a small anchor conversation and the new
messages, right after the anchor's turns. Templates like Qwen's list the tools in the system turn, before
every message past the first: there a harness's tools (a dozen schemas, ~20,000 characters for Codex) are
copied, dumped as JSON and rendered again in every bridge, most of a bridge's cost, for text the cut throws
away. This reads the template's Jinja syntax tree and says yes only where it is certain the tools change
nothing past that cut. A template's output is its top-level statements' outputs in order; the answer is
yes when:

- every top-level statement up to the last one that reads ``tools`` renders the same for every conversation
  with the same first message: it reads the conversation only as ``messages[0]`` or as whether it is empty
  (``messages | length > 0``), names set from those alone, and macros that read neither ``messages`` nor
  ``tools`` and change no namespace; it is an output, an ``if``, a ``for``, a ``set`` or a macro definition;
- the statements that read ``tools`` set nothing (no ``set``, no namespace change, no macro), so nothing
  they compute reaches the statements after them;
- no macro reads ``tools``, and nothing after the last statement that reads ``tools`` reads it.

Then a render is ``head(tools) + rest`` where ``head`` is the same for the anchor alone and for the anchor
with new messages (they share the first message), and ``rest`` does not depend on the tools: the bridge
cut after the anchor's turns is the same text with or without them, and (the cut falling on an end-of-turn
special token, which the tokenizer splits on) the same tokens. A template that reads the tools anywhere
else (Llama 3.1 in the first user message, Mistral before the last one) or in a way this cannot follow
gets no; a template that does not read them at all gets yes. ``core.rendering`` also checks the answer on
canonical bridges when it decides on local rendering, and the live render check compares bridges with
the engine's, which renders the tools.
"""

from __future__ import annotations

from collections.abc import Iterator

import jinja2
import jinja2.nodes as nodes

from rollout_proxy.tokenization.vllm_chat import parse_template

#: statements a head may hold; anything else (includes, blocks, ``{% generation %}``...) means: not known
_HEAD_STATEMENTS = (nodes.Output, nodes.If, nodes.For, nodes.Assign, nodes.Macro)
_SETS = (nodes.Assign, nodes.AssignBlock, nodes.Macro, nodes.NSRef)
#: ``messages | length`` compared so that it says only whether the list is empty (the anchor never is)
_NOT_EMPTY = {("gt", 0), ("gteq", 1), ("ne", 0)}


def tools_only_shape_the_head(template: str) -> bool:
    """Whether a bridge renders the same with the tools left out (the module docstring)."""
    try:
        tree = parse_template(template)
    except jinja2.TemplateError:
        return False
    return _Reading(tree).tools_only_shape_the_head()


def _walk(node: nodes.Node) -> Iterator[nodes.Node]:
    yield node
    for child in node.iter_child_nodes():
        yield from _walk(child)


def _parents(node: nodes.Node) -> dict[int, nodes.Node]:
    found: dict[int, nodes.Node] = {}
    for parent in _walk(node):
        for child in parent.iter_child_nodes():
            found[id(child)] = parent
    return found


def _reads(node: nodes.Node, name: str) -> bool:
    return any(isinstance(n, nodes.Name) and n.ctx == "load" and n.name == name for n in _walk(node))


class _Reading:
    def __init__(self, tree: nodes.Template) -> None:
        self._body = tree.body
        self._parents = _parents(tree)
        self._macros = {macro.name: macro for macro in tree.find_all(nodes.Macro)}
        self._namespaces = {ref.name for ref in tree.find_all(nodes.NSRef)}
        self._set_at_top = {  # names a top-level ``set`` assigns
            target.name
            for statement in self._body
            if isinstance(statement, nodes.Assign | nodes.AssignBlock)
            for target in _walk(statement.target)
            if isinstance(target, nodes.Name)
        }

    def tools_only_shape_the_head(self) -> bool:
        reading = [index for index, statement in enumerate(self._body) if _reads(statement, "tools")]
        if not reading:
            return True
        if any(_reads(macro, "tools") for macro in self._macros.values()):
            return False
        safe: set[str] = set()  # top-level names set from the first message alone
        for index, statement in enumerate(self._body[: reading[-1] + 1]):
            if not isinstance(statement, _HEAD_STATEMENTS):
                return False
            if index in reading and any(isinstance(n, _SETS) for n in _walk(statement)):
                return False
            if isinstance(statement, nodes.Macro):
                continue  # read where it is called
            if not self._first_message_only(statement, safe):
                return False
            if isinstance(statement, nodes.Assign) and isinstance(statement.target, nodes.Name):
                safe.add(statement.target.name)
        return True

    def _first_message_only(self, statement: nodes.Node, safe: set[str]) -> bool:
        """Whether ``statement`` renders (and sets) the same for conversations that share the first message."""
        local = {n.name for n in _walk(statement) if isinstance(n, nodes.Name) and n.ctx in ("store", "param")}
        for node in _walk(statement):
            if isinstance(node, nodes.NSRef):
                return False
            called = self._called(node)
            if called is not None and not self._pure(called):
                return False
            if not isinstance(node, nodes.Name) or node.ctx != "load":
                continue
            if node.name == "messages":
                if not self._first_message_read(node):
                    return False
            elif node.name in self._namespaces or (node.name in self._set_at_top and node.name not in safe | local):
                return False
        return True

    def _first_message_read(self, name: nodes.Name) -> bool:
        """``messages[0]`` (and what is read from it), or ``messages | length`` compared with emptiness."""
        parent = self._parents.get(id(name))
        if isinstance(parent, nodes.Getitem) and parent.node is name:
            return isinstance(parent.arg, nodes.Const) and parent.arg.value == 0
        if isinstance(parent, nodes.Filter) and parent.node is name and parent.name == "length" and not parent.args:
            compare = self._parents.get(id(parent))
            return (
                isinstance(compare, nodes.Compare)
                and compare.expr is parent
                and len(compare.ops) == 1
                and isinstance(compare.ops[0].expr, nodes.Const)
                and (compare.ops[0].op, compare.ops[0].expr.value) in _NOT_EMPTY
            )
        return False

    def _pure(self, macro: nodes.Macro, calling: frozenset[str] = frozenset()) -> bool:
        """A macro that renders from its arguments alone: it reads no conversation, no name set at the top
        and no namespace, changes none, and calls only such macros."""
        if macro.name in calling:
            return False  # recursion: not followed
        local = {n.name for n in _walk(macro) if isinstance(n, nodes.Name) and n.ctx in ("store", "param")}
        for node in _walk(macro):
            if isinstance(node, nodes.NSRef):
                return False
            called = self._called(node)
            if called is not None and not self._pure(called, calling | {macro.name}):
                return False
            if (
                isinstance(node, nodes.Name)
                and node.ctx == "load"
                and node.name not in local
                and self._shared(node.name)
            ):
                return False
        return True

    def _called(self, node: nodes.Node) -> nodes.Macro | None:
        """The template's macro ``node`` calls, if it is such a call."""
        if isinstance(node, nodes.Call) and isinstance(node.node, nodes.Name):
            return self._macros.get(node.node.name)
        return None

    def _shared(self, name: str) -> bool:
        """A name whose value a macro would not get from its arguments: the conversation, a namespace, a name
        set at the top."""
        return name == "messages" or name in self._namespaces or name in self._set_at_top
