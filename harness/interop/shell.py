"""A launch script's command line, its variables resolved as bash would, without running it.

Megatron-LM's example scripts (examples/*/train_*.sh) build the pretrain_gpt.py command from their own
variables: `NAME=value`, `${NAME:-default}`, `$((A*B))`, arrays of flags (`ARGS=(...)`, `ARGS+=(...)`,
`${ARGS[@]}`) and `if [[ "$X" == "y" ]]` blocks. This module reads them statement by statement and
returns the words of the last command that runs a `*.py` program, expanded; nothing is executed. The
script is taken as run with no arguments in an empty environment: `$1` or `$HOME` without a default is
unresolved, and a word built from one carries UNRESOLVED markers naming it (`unresolved()` reads them),
as does a variable assigned in a loop or under a condition this module cannot decide. Text that runs
no program (an argument file) is one command: all its words.
"""

from __future__ import annotations

import operator

from harness.errors import SpecError
from harness.interop.shell_words import ASSIGN, FLAGS, MARK, Script, _mark, _words, unresolved

__all__ = ["FLAGS", "command_words", "unresolved"]
SKIP_WORDS = {"echo", "printf", "[", "[[", "test", "mkdir", "cd", "source", ".", "set"}


# ---------------------------------------------------------------- statements

SEPARATORS = {"\n", ";", "&&", "||", "|", "&", ";;"}


def _literal(tok) -> str | None:
    """An unquoted literal word's text (a keyword candidate), else None."""
    if isinstance(tok, list) and all(k == "lit" and not q for k, _, q in tok):
        return "".join(s for _, s, _ in tok)
    return None


def _render(tok) -> str:
    if isinstance(tok, str):
        return tok.strip("\n")
    text = "".join(
        s if k == "lit" else "$((" + s + "))" if k == "arith" else "$(" + s + ")" if k == "cmd" else "${" + s + "}"
        for k, s, _ in tok
    )
    return text


def _until(tokens: list, i: int, word: str) -> tuple[list, int]:
    """The tokens from i up to the literal `word` (at command position or not), and the index after it."""
    out = []
    while i < len(tokens) and _literal(tokens[i]) != word:
        out.append(tokens[i])
        i += 1
    return out, i + 1


def _parse(tokens: list, i: int, stop: set) -> tuple[list, int, str | None]:
    """Statements from i up to one of the keywords in `stop`: ("assign", name, append, words, is_array),
    ("cmd", words), ("if", [(condition, body)], else_body), ("loop", text, body), ("opaque", text, words)."""
    nodes = []
    while i < len(tokens):
        tok = tokens[i]
        if isinstance(tok, str):
            i += 1
            continue
        kw = _literal(tok)
        if kw in stop:
            return nodes, i + 1, kw
        if kw == "if":
            branches, other = [], []
            while True:
                cond, i = _until(tokens, i + 1, "then")
                body, i, end = _parse(tokens, i, {"elif", "else", "fi"})
                branches.append((cond, body))
                if end == "elif":
                    i -= 1
                    continue
                if end == "else":
                    other, i, _ = _parse(tokens, i, {"fi"})
                break
            nodes.append(("if", branches, other))
        elif kw in ("while", "until", "for"):
            cond, i = _until(tokens, i + 1, "do")
            body, i, _ = _parse(tokens, i, {"done"})
            nodes.append(("loop", kw, cond, body))
        elif kw == "case":
            words, i = _until(tokens, i + 1, "esac")
            nodes.append(("opaque", "case " + _render(words[0]) if words else "case", words))
        elif (head := _assign_head(tok)) and not head[2] and i + 1 < len(tokens) and tokens[i + 1] == "(":
            items, i = [], i + 2  # NAME=( words... ), across lines
            while i < len(tokens) and tokens[i] != ")":
                if isinstance(tokens[i], list):
                    items.append(tokens[i])
                i += 1
            nodes.append(("assign", head[0], head[1], items, True))
            i += 1
        else:
            words = []
            while i < len(tokens) and not (isinstance(tokens[i], str) and tokens[i] in SEPARATORS):
                words.append(tokens[i])
                i += 1
            nodes.extend(_statement(words))
    return nodes, i, None


def _statement(words: list) -> list:
    """One simple command's nodes: its assignments (export's too), then the command if any."""
    words = [w for w in words if isinstance(w, list)]
    if words and _literal(words[0]) in ("export", "local", "declare", "readonly"):
        words = [w for w in words[1:] if not (_literal(w) or "").startswith("-")]
        return [("assign", h[0], h[1], [h[2]], False) for w in words if (h := _assign_head(w))]
    nodes = []
    while words and (head := _assign_head(words[0])):
        nodes.append(("assign", head[0], head[1], [head[2]], False))
        words = words[1:]
    return nodes + ([("cmd", words)] if words else [])


def _assign_head(word):
    """(name, append, value parts) when the word is NAME=value or NAME+=value."""
    if not isinstance(word, list) or not word or word[0][0] != "lit" or word[0][2]:
        return None
    m = ASSIGN.fullmatch(word[0][1])
    if m is None:
        return None
    rest = [("lit", m.group(3), False)] if m.group(3) else []
    return m.group(1), bool(m.group(2)), rest + word[1:]


# ---------------------------------------------------------------- evaluation

COMPARE = {"==": operator.eq, "=": operator.eq, "!=": operator.ne}
NUMERIC = {"-eq": operator.eq, "-ne": operator.ne, "-gt": operator.gt, "-ge": operator.ge, "-lt": operator.lt}
NUMERIC["-le"] = operator.le


def _test(sh: Script, words: list) -> bool | None:
    """One `[[ ... ]]` / `[ ... ]` / `test ...`: True, False, or None when it cannot be decided here."""
    lits = [_literal(w) for w in words]
    if lits and lits[0] in ("[[", "[", "test"):
        words, lits = words[1:], lits[1:]
        if lits and lits[-1] in ("]]", "]"):
            words, lits = words[:-1], lits[:-1]
    negate = bool(lits) and lits[0] == "!"
    if negate:
        words, lits = words[1:], lits[1:]
    vals = ["".join(sh.expand_word(w, split=False)) for w in words]
    if any(unresolved(v) for v in vals):
        return None
    if len(vals) == 2 and lits[0] in ("-n", "-z"):
        got = (vals[1] != "") == (lits[0] == "-n")
    elif len(vals) == 3 and lits[1] in COMPARE:
        got = COMPARE[lits[1]](vals[0], vals[2])
    elif len(vals) == 3 and lits[1] in NUMERIC:
        try:
            got = NUMERIC[lits[1]](int(vals[0]), int(vals[2]))
        except ValueError:
            return None
    else:
        return None
    return got != negate


def _condition(sh: Script, cond: list) -> bool | None:
    """A condition of tests joined by && and || (left to right, as bash), three-valued."""
    result, op, words = None, None, []
    for tok in [*cond, "||"]:
        if isinstance(tok, str) and tok in ("&&", "||", ";", "\n"):
            if words:
                got = _test(sh, words)
                if op is None:
                    result = got
                elif op == "&&":
                    result = False if result is False or got is False else None if None in (result, got) else True
                else:
                    result = True if result is True or got is True else None if None in (result, got) else False
                op, words = (tok if tok in ("&&", "||") else op), []
            continue
        words.append(tok)
    return result


def _assigned(nodes: list) -> list[tuple[str, bool]]:
    """(name, append) of every assignment in the nodes, however deep."""
    out = []
    for n in nodes:
        if n[0] == "assign":
            out.append((n[1], n[2]))
        elif n[0] == "if":
            out += _assigned([x for _, body in n[1] for x in body] + n[2])
        elif n[0] == "loop":
            out += _assigned(n[3])
        elif n[0] == "opaque":
            out += [(h[0], h[1]) for w in n[2] if (h := _assign_head(w))]
    return out


def _run(sh: Script, nodes: list, commands: list) -> None:
    for n in nodes:
        if n[0] == "assign":
            _, name, append, words, is_array = n
            if is_array:
                value = [f for w in words for f in sh.expand_word(w)]
            else:
                value = "".join(sh.expand_word(words[0], split=False)) if words[0] else ""
            old = sh.vars.get(name)
            if append:
                old = old if isinstance(old, list) else [] if old is None else [old]
                value = (
                    old + (value if isinstance(value, list) else [value])
                    if is_array
                    else (old[0] if old else "") + value
                )
            sh.vars[name] = value
        elif n[0] == "cmd":
            commands.append([f for w in n[1] for f in sh.expand_word(w)])
        elif n[0] == "if":
            for cond, body in n[1]:
                got = _condition(sh, cond)
                if got is None:
                    _undecided(sh, "if " + " ".join(_render(t) for t in cond), [x for _, b in n[1] for x in b] + n[2])
                    break
                if got:
                    _run(sh, body, commands)
                    break
            else:
                _run(sh, n[2], commands)
        elif n[0] == "loop":
            if n[1] == "while" and _condition(sh, n[2]) is False:
                continue
            _undecided(sh, f"{n[1]} " + " ".join(_render(t) for t in n[2]), n[3])
        else:
            _undecided(sh, n[1], [])
            for name, append in _assigned([n]):
                _set_unresolved(sh, name, append, n[1])


def _undecided(sh: Script, what: str, nodes: list) -> None:
    for name, append in _assigned(nodes):
        _set_unresolved(sh, name, append, what)


def _set_unresolved(sh: Script, name: str, append: bool, what: str) -> None:
    old = sh.vars.get(name)
    marker = _mark(f"{name} (set under `{what.strip()}`)")
    if append and isinstance(old, list):
        sh.vars[name] = old + [FLAGS + marker]
    else:
        sh.vars[name] = marker


def command_words(text: str) -> list[str]:
    """The words of the script's last command that runs a `*.py` program (its launcher's words
    first), expanded; for text that runs no program, every command's words in order."""
    if MARK in text or FLAGS in text:
        raise SpecError("script", "holds control bytes (NUL): not a launch script")
    nodes, _, _ = _parse(_words(text), 0, set())
    commands: list[list[str]] = []
    _run(Script(), nodes, commands)
    launches = [c for c in commands if c and c[0] not in SKIP_WORDS and any(w.endswith(".py") for w in c)]
    if launches:
        return launches[-1]
    return [w for c in commands if c and c[0] not in SKIP_WORDS for w in c]
