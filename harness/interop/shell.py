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

import ast
import operator
import re

from harness.errors import SpecError

MARK = "\x00"  # UNRESOLVED markers: MARK + what + MARK inside a word
FLAGS = "\x01"  # before a marker that stands for words appended to an array (flags, not a flag's value)
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)", re.S)
SKIP_WORDS = {"echo", "printf", "[", "[[", "test", "mkdir", "cd", "source", ".", "set"}


def unresolved(word: str) -> list[str]:
    """What a word depends on that the script does not set (empty when it is resolved)."""
    return word.split(MARK)[1::2]


def _mark(what: str) -> str:
    return f"{MARK}{what}{MARK}"


# ---------------------------------------------------------------- words


def _words(text: str) -> list:
    """The script as a list of words (each a list of (kind, text, quoted) parts) and operators
    ("\\n", ";", "&&", "||", "|", "(", ")", "&")."""
    out, word, i, n = [], None, 0, len(text)

    def part(kind, s, quoted=False):
        nonlocal word
        word = word if word is not None else []
        if kind == "lit" and word and word[-1][0] == "lit" and word[-1][2] == quoted:
            word[-1] = ("lit", word[-1][1] + s, quoted)
        else:
            word.append((kind, s, quoted))

    def end():
        nonlocal word
        if word is not None:
            out.append(word)
            word = None

    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            if text[i + 1] != "\n":
                part("lit", text[i + 1])
            i += 2
        elif c in " \t\r":
            end()
            i += 1
        elif c == "#" and word is None:
            while i < n and text[i] != "\n":
                i += 1
        elif c == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise SpecError("script", f"line {text.count(chr(10), 0, i) + 1}: unclosed single quote")
            part("lit", text[i + 1 : j], True)
            word = word if word is not None else []
            i = j + 1
        elif c == '"':
            i = _double(text, i + 1, part, i)
            word = word if word is not None else []
        elif c == "$":
            kind, s, i = _dollar(text, i)
            part(kind, s)
        elif c in "\n;&|()":
            end()
            two = text[i : i + 2]
            op = two if two in ("&&", "||", ";;") else c
            out.append(op)
            i += len(op)
        else:
            part("lit", c)
            i += 1
    end()
    return out


def _double(text: str, i: int, part, start: int) -> int:
    """A double-quoted string from i (after the quote): literal text and expansions, quoted."""
    buf = []
    while i < len(text):
        c = text[i]
        if c == '"':
            if buf:
                part("lit", "".join(buf), True)
            return i + 1
        if c == "\\" and i + 1 < len(text) and text[i + 1] in '"\\$`\n':
            if text[i + 1] != "\n":
                buf.append(text[i + 1])
            i += 2
        elif c == "$":
            if buf:
                part("lit", "".join(buf), True)
                buf = []
            kind, s, i = _dollar(text, i)
            part(kind, s, True)
        else:
            buf.append(c)
            i += 1
    raise SpecError("script", f"line {text.count(chr(10), 0, start) + 1}: unclosed double quote")


def _closing(text: str, i: int, opening: str, closing: str) -> int:
    """The index of the bracket closing the one before i."""
    depth = 1
    while i < len(text):
        if text[i] == opening:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise SpecError("script", f"line {text.count(chr(10), 0, i) + 1}: unclosed {opening}")


def _dollar(text: str, i: int) -> tuple[str, str, int]:
    """The expansion at text[i] == "$": (kind, body, index after it)."""
    rest = text[i + 1 : i + 3]
    if rest.startswith("(("):
        j = _closing(text, i + 3, "(", ")")
        if text[j + 1 : j + 2] != ")":
            raise SpecError("script", f"line {text.count(chr(10), 0, i) + 1}: unclosed $((")
        return "arith", text[i + 3 : j], j + 2
    if rest.startswith("("):
        j = _closing(text, i + 2, "(", ")")
        return "cmd", text[i + 2 : j], j + 1
    if rest.startswith("{"):
        j = _closing(text, i + 2, "{", "}")
        return "var", text[i + 2 : j], j + 1
    m = NAME.match(text, i + 1)
    if m:
        return "var", m.group(), m.end()
    if rest[:1] and (rest[0].isdigit() or rest[0] in "#@*?$!"):
        return "var", rest[0], i + 2
    return "lit", "$", i + 1


# ---------------------------------------------------------------- expansion


class Script:
    """The variables (str, or list for arrays) as the statements so far have set them."""

    def __init__(self):
        self.vars: dict = {"#": "0"}

    def value(self, body: str):
        """${body}: a str, or a list for `NAME[@]`."""
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9#@*?])(\[[@*]\])?(?:(:?[-=+])(.*))?", body, re.S)
        if m is None:
            return _mark("${" + body + "}")
        name, index, op, word = m.groups()
        v = self.vars.get(name)
        if index:
            return list(v) if isinstance(v, list) else [] if v is None else [v]
        if isinstance(v, list):
            v = v[0] if v else ""
        empty = v is None or (op is not None and op.startswith(":") and v == "")
        if op and op.endswith(("-", "=")) and empty:
            v = "".join(self.expand_word(_words(word)[0] if _words(word) else [], split=False))
            if op.endswith("="):
                self.vars[name] = v
        elif op and op.endswith("+"):
            v = "" if empty else "".join(self.expand_word(_words(word)[0] if _words(word) else [], split=False))
        if v is None:
            return _mark("$" + name)
        return v

    def expand_word(self, word: list, split: bool = True) -> list[str]:
        """A word's expansion: unquoted expansions split on whitespace (bash's word splitting), a
        quoted ${A[@]} one word per element."""
        fields, cur, any_quoted = [], [""], False
        for kind, s, quoted in word:
            any_quoted |= quoted
            if kind == "lit":
                cur[-1] += s
                continue
            v = self.arith(s) if kind == "arith" else _mark("$(" + s + ")") if kind == "cmd" else self.value(s)
            items = v if isinstance(v, list) else [v]
            if quoted or not split:
                pieces = [items]
            else:
                pieces = [[w for it in items for w in it.split()]]
            for k, item in enumerate(pieces[0]):
                if k:
                    fields.append(cur[-1])
                    cur = [""]
                cur[-1] += item
        if cur[-1] or any_quoted or fields:
            fields.append(cur[-1])
        return fields

    def arith(self, expr: str) -> str:
        """$((expr)) over integers and the script's variables."""
        text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expr)
        names = {n: self.vars.get(n) for n in NAME.findall(text)}
        missing = [n for n, v in names.items() if v is None or isinstance(v, list) or unresolved(v)]
        if missing:
            return _mark("$" + missing[0])
        try:
            return str(_int_eval(ast.parse(text.strip(), mode="eval").body, names))
        except (SyntaxError, ValueError, ZeroDivisionError, TypeError):
            return _mark("$((" + expr + "))")


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_OPS.update({ast.Div: operator.floordiv, ast.Mod: operator.mod})


def _int_eval(node, names: dict) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return int(names[node.id] or 0)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_int_eval(node.left, names), _int_eval(node.right, names))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int_eval(node.operand, names)
    raise ValueError(ast.dump(node))


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
    text = "".join(s if k == "lit" else "$((" + s + "))" if k == "arith" else "$(" + s + ")" if k == "cmd" else "${" + s + "}" for k, s, _ in tok)
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
                value = old + (value if isinstance(value, list) else [value]) if is_array else (old[0] if old else "") + value
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
