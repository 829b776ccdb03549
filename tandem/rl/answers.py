r"""Find and compare final numeric answers in model output, without dependencies.

Understands integers, decimals, thousands separators (1,234 and 1{,}234), negative numbers
(including the Unicode minus), a/b, LaTeX \frac{a}{b} / \dfrac / \tfrac / \frac12, and a final
answer marked by \boxed{}, <answer></answer>, "the answer is", "Answer:" or "####".
Values compare exactly, as fractions: 0.5 == 1/2 == \frac{1}{2}, 82 == 82.0.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
# A minus sign that is not a subtraction: "3-5" and "10 - 3" do not contain -5 or -3.
_SIGN = r"(?:(?<![\w)\]}])(?<![\w)\]}]\s)[-−]\s*)?"
_TOKEN_RE = re.compile(
    _SIGN + r"(?:"
    r"\\[dt]?frac\s*\{\s*(?P<fn>-?" + _NUM + r")\s*\}\s*\{\s*(?P<fd>-?" + _NUM + r")\s*\}"
    r"|\\[dt]?frac(?P<sn>\d)(?P<sd>\d)"
    r"|(?P<an>" + _NUM + r")\s*/\s*(?P<ad>" + _NUM + r")(?![\d/])"
    r"|(?P<n>" + _NUM + r")"
    r")"
)
_MARKER_RE = re.compile(r"(?:answer\s*(?:is|:|=)|####)\s*:?", re.IGNORECASE)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def _normalize(text: str) -> str:
    text = text.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\ ", " ")
    text = text.replace("\\left", "").replace("\\right", "").replace("−", "-")
    return text


def _token_value(m: re.Match[str]) -> Fraction | None:
    negative = m.group(0).lstrip().startswith(("-", "−"))
    g = m.groupdict()
    try:
        if g["fn"] is not None:
            value = _to_fraction(g["fn"]) / _to_fraction(g["fd"])
        elif g["sn"] is not None:
            value = Fraction(int(g["sn"]), int(g["sd"]))
        elif g["an"] is not None:
            value = _to_fraction(g["an"]) / _to_fraction(g["ad"])
        else:
            value = _to_fraction(g["n"])
    except ZeroDivisionError:
        return None
    return -value if negative else value


def _to_fraction(s: str) -> Fraction:
    return Fraction(s.replace(",", ""))


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def answer_region(text: str) -> str | None:
    """The content of the last \\boxed{} (or else of the last <answer></answer>), if any."""
    text = _normalize(text)
    region = _last_boxed(text)
    return region if region is not None else _last_tag(text)


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a completion, as text, or None if it has none.

    Only the marked answer or the last number counts, so restating the question ("37 + 45 is
    ...") scores nothing by itself.
    """
    region = answer_region(text)
    if region is not None:
        tokens = list(_TOKEN_RE.finditer(region))
        return tokens[-1].group(0).strip() if tokens else region.strip()
    text = _normalize(text)
    markers = list(_MARKER_RE.finditer(text))
    if markers:
        m = _TOKEN_RE.search(text, markers[-1].end())
        if m:
            return m.group(0).strip()
    tokens = list(_TOKEN_RE.finditer(text))
    return tokens[-1].group(0).strip() if tokens else None


def _last_tag(text: str) -> str | None:
    found = _ANSWER_TAG_RE.findall(text)
    return found[-1] if found else None


def parse_number(text: str) -> Fraction | None:
    """The value of a string that is exactly one number ($, %, +, a final '.' allowed around it)."""
    s = _normalize(text).strip().strip("$").strip()
    for wrap in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(wrap[0]) and s.endswith(wrap[1]):
            s = s[2:-2].strip()
    s = s.rstrip(".").rstrip("%").strip().lstrip("+")
    m = _TOKEN_RE.fullmatch(s)
    return _token_value(m) if m else None


def answers_match(pred: str, gold: str | Fraction) -> bool:
    """Whether the predicted answer text has the gold value."""
    gold_value = parse_number(gold) if isinstance(gold, str) else gold
    pred_value = parse_number(pred)
    return gold_value is not None and pred_value is not None and pred_value == gold_value
