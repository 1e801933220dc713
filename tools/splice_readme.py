"""Replace the README section between `<!-- NAME:begin -->` and `<!-- NAME:end -->` with a file."""
import re
import sys
from pathlib import Path


def main(name: str, src: str, readme: str = "README.md") -> int:
    text = Path(readme).read_text()
    body = Path(src).read_text().strip()
    pat = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
    if not pat.search(text):
        print(f"splice_readme: {readme}: no '{name}' markers", file=sys.stderr)
        return 2
    Path(readme).write_text(pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
