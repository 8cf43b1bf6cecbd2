"""A stage's backward in two passes, for the zero-bubble schedule (``zb-h1`` in
:mod:`longboat.pipeline.schedules`).

[Note: split backward] A stage's backward computes two things from its output's gradient: its
input's gradient, which the stage before waits for, and its parameters' gradients, which no one
needs before the optimizer step. ``I`` computes the first alone
(``torch.autograd.grad`` with respect to the inputs, the graph kept) and ``W`` the second later.
Recomputing the whole backward in ``W`` would cost a full backward again; instead ``I`` keeps
the gradient that reaches each *meeting node*, a node on the way from the output to the inputs
that a parameter's gradient also flows through (a matrix product: its input's and its weight's
gradients part there), and ``W`` starts from those nodes and runs only the branches that lead
to parameters. torch.distributed.pipelining splits its stages' backward the same way
(``stage_backward_input`` / ``stage_backward_weight``).

``W`` runs ``torch.autograd.backward(..., inputs=parameters)``: each parameter's gradient
accumulator runs as in the unsplit backward, so ``.grad`` accumulates across micro-batches as
before and the hooks the data-parallel strategy keeps on it fire. Parameters are grouped by the
meeting nodes they share (a weight used twice in a stage reaches two); a group's nodes are
replayed together, each pinned to the gradient ``I`` saw, so that a node below another in the
same group does not count twice what flows down to it. Frozen parameters and parameters this
micro-batch did not use have no accumulator in the graph and get no gradient, as in the unsplit
backward. A stage whose inputs need no gradient (the first, or one fed integers) has nothing to
send: ``I`` does nothing and ``W`` is the whole backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.utils.hooks import RemovableHandle


def _node(t: torch.Tensor) -> Node | None:
    """The node autograd runs for ``t``'s gradient: its ``grad_fn``, or for a leaf that needs a
    gradient, its gradient accumulator (made on demand, hence the view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view = t.view_as(t).grad_fn
    assert view is not None, "a leaf that needs a gradient has an accumulator"
    return view.next_functions[0][0]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Every node of the graph below ``root``, with the nodes whose gradient flows into it."""
    into: dict[Node, list[Node]] = {root: []}
    todo = deque([root])
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in into:
                into[child] = []
                todo.append(child)
            into[child].append(node)
    return into


def _upward(
    starts: Sequence[Node], into: dict[Node, list[Node]], stop: dict[Node, None]
) -> dict[Node, None]:
    """The nodes from ``starts`` up towards the root, not going past (but naming) the nodes in
    ``stop``: with an empty ``stop``, all of them; else the ``stop`` nodes reached. Ordered by
    discovery, so that every rank replays a stage's groups in the same order."""
    seen: dict[Node, None] = dict.fromkeys(starts)
    reached: dict[Node, None] = {}
    todo = deque(starts)
    while todo:
        for up in into.get(todo.popleft(), []):
            if up in stop:
                reached[up] = None
            elif up not in seen:
                seen[up] = None
                todo.append(up)
    return reached if stop else seen


@dataclass
class _Group:
    """Parameters whose gradients part from the input's path at the same meeting nodes."""

    params: list[torch.Tensor] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)


@dataclass
class WeightPass:
    """What ``I`` leaves for ``W``: call it once to accumulate the parameters' gradients."""

    groups: list[tuple[list[torch.Tensor], list[Node], list[tuple[torch.Tensor | None, ...]]]]
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (root, its gradient)

    def __call__(self) -> None:
        if self.whole is not None:
            root, grad = self.whole
            torch.autograd.backward(root, grad)
        for params, nodes, grads in self.groups:
            roots = [
                GradientEdge(n, i)
                for n, gs in zip(nodes, grads, strict=True)
                for i, g in enumerate(gs)
                if g is not None
            ]
            values = [g for gs in grads for g in gs if g is not None]
            if not roots:  # no gradient reached these nodes in I: none for their parameters
                continue
            handles: list[RemovableHandle] = []
            if len(nodes) > 1:  # pin each node to what I saw: nothing counted twice
                for n, gs in zip(nodes, grads, strict=True):
                    handles.append(n.register_prehook(lambda _, gs=gs: gs))
            try:
                # The graph stays until the pass is dropped: groups may share nodes below.
                torch.autograd.backward(roots, values, retain_graph=True, inputs=params)
            finally:
                for h in handles:
                    h.remove()
        self.groups, self.whole = [], None  # once: the graph can go


def backward_input(
    root: torch.Tensor,
    grad: torch.Tensor | None,
    inputs: Sequence[torch.Tensor | None],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightPass]:
    """``I`` of [Note: split backward]: the gradients of ``inputs`` from ``root`` (a stage's
    output with its gradient ``grad``, or a scalar loss with ``grad`` None), and the
    :class:`WeightPass` that later puts ``params``' gradients into their ``.grad``."""
    wanted = [x for x in inputs if x is not None and x.requires_grad]
    top = root.grad_fn
    if top is None:
        # No operation made the output: a stage that passed its input on unchanged (a layer
        # that skipped its branch on this micro-batch) hands back the gradient it got; other
        # than that, nothing here needs a gradient.
        return [grad if x is root else None for x in inputs], WeightPass([])
    into = _consumers(top)
    starts = [n for n in (_node(x) for x in wanted) if n is not None and n in into]
    on_path = _upward(starts, into, {}) if starts else {}
    if top not in on_path:  # the inputs do not reach the output: nothing to send
        return [None] * len(inputs), WeightPass([], whole=(root, grad))
    groups: dict[Node, _Group] = {}  # by meeting node
    for p in params:
        acc = _node(p) if p.requires_grad else None
        if acc is None or acc not in into:
            continue  # frozen, or unused by this micro-batch
        meets = list(_upward([acc], into, on_path))
        merged = {id(groups[n]): groups[n] for n in meets if n in groups}
        group = _Group()
        for g in merged.values():  # a node shared with earlier groups joins them
            group.params += g.params
            group.nodes += [n for n in g.nodes if n not in group.nodes]
        group.params.append(p)
        group.nodes += [n for n in meets if n not in group.nodes]
        for n in group.nodes:
            groups[n] = group
    seen: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keep(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            seen[node] = tuple(grads)

        return hook

    handles = [n.register_prehook(keep(n)) for n in groups]
    try:
        found = torch.autograd.grad(
            [root],
            wanted,
            None if grad is None else [grad],
            retain_graph=True,
            allow_unused=True,
        )
    finally:
        for h in handles:
            h.remove()
    by_input = dict(zip(map(id, wanted), found, strict=True))
    unique = list({id(g): g for g in groups.values()}.values())
    return [None if x is None else by_input.get(id(x)) for x in inputs], WeightPass(
        [(g.params, g.nodes, [seen[n] for n in g.nodes]) for g in unique]
    )
