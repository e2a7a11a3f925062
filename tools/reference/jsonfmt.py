"""Compact-but-readable JSON: objects are indented, lists of scalars go on one line."""

import json


def _is_scalar(x):
    return x is None or isinstance(x, (bool, int, float, str))


def dumps(obj, indent=2, _level=0):
    pad = " " * (indent * (_level + 1))
    end = " " * (indent * _level)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        if all(_is_scalar(v) for v in obj.values()):
            one = json.dumps(obj, ensure_ascii=False)
            if len(one) <= 120:
                return one
        items = [
            f"{pad}{json.dumps(str(k), ensure_ascii=False)}: {dumps(v, indent, _level + 1)}"
            for k, v in obj.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(obj, (list, tuple)):
        if all(_is_scalar(x) for x in obj):
            return json.dumps(list(obj), ensure_ascii=False)
        items = [pad + dumps(v, indent, _level + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + end + "]"
    return json.dumps(obj, ensure_ascii=False)


def dump_file(obj, path):
    with open(path, "w", encoding="utf-8") as f:
        f.write(dumps(obj))
        f.write("\n")
