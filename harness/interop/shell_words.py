"""A launch script's words and their expansion, as bash reads them (harness/interop/shell.py runs the
statements): quotes, comments, line continuations, `$NAME`, `${NAME:-default}`, `${NAME[@]}`, `$((A*B))`;
`$(...)` and anything unset without a default become UNRESOLVED markers naming it (`unresolved()`)."""

from __future__ import annotations

import ast
import operator
import re

from harness.errors import SpecError

MARK = "\x00"  # UNRESOLVED markers: MARK + what + MARK inside a word
FLAGS = "\x01"  # before a marker that stands for words appended to an array (flags, not a flag's value)
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)", re.S)


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
