#!/usr/bin/env python3
"""Checks the links of built HTML pages and of Markdown files, without the network.

    scripts/check-links.py docs/book README.md ARCHITECTURE.md docs/src

Each argument is an HTML or Markdown file, or a folder whose *.html and *.md files are all
checked. For every link (`href` and `src` attributes, Markdown links, images and reference
definitions, outside code):

- a relative link must name a file or folder that exists (resolved from the linking
  file's folder; a link starting with `/` from the folder given on the command line);
- a `#fragment` must be an `id` (or `name`) in the target HTML page, or a heading's anchor
  (or an HTML `id`) in the target Markdown file, GitHub's and mdBook's way of making
  anchors from headings (lowercase; letters, digits, `-` and `_` kept, spaces to `-`,
  everything else dropped; repeated headings get `-1`, `-2`, ...);
- an http(s) link is only checked for its syntax (a scheme, a host, no spaces); mailto:,
  javascript: and data: links are left alone.

Exits 0 when every link resolves, 1 with the broken ones listed (`file:line: link: why`),
2 on bad usage.
"""

import html.parser
import os
import re
import sys
import urllib.parse

SKIPPED_SCHEMES = ("mailto:", "javascript:", "data:", "tel:")


def slug(text):
    """The anchor GitHub and mdBook give a heading with this text."""
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = text.replace("`", "")
    out = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return "".join(out)


class HtmlPage(html.parser.HTMLParser):
    """The ids of an HTML page and its links with their lines."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (name == "name" and tag == "a"):
                self.ids.add(value)
            elif name in ("href", "src"):
                self.links.append((self.getpos()[0], value))

    handle_startendtag = handle_starttag


FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
MD_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
AUTOLINK = re.compile(r"<(https?://[^>\s]+)>")
HTML_ATTR = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']*)["']""")
HTML_ID = re.compile(r"""\b(?:id|name)\s*=\s*["']([^"']*)["']""")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


class MarkdownPage:
    """The anchors of a Markdown file and its links with their lines."""

    def __init__(self, text):
        self.ids = set()
        self.links = []
        seen = {}
        in_fence = None
        for number, line in enumerate(text.split("\n"), 1):
            fence = FENCE.match(line)
            if fence:
                if in_fence is None:
                    in_fence = fence.group(1)
                elif fence.group(1) == in_fence:
                    in_fence = None
                continue
            if in_fence is not None:
                continue
            heading = HEADING.match(line)
            if heading:
                base = slug(heading.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                self.ids.add(base if n == 0 else f"{base}-{n}")
            self.ids.update(HTML_ID.findall(line))
            code_free = INLINE_CODE.sub("", line)
            for pattern in (MD_LINK, AUTOLINK, HTML_ATTR):
                for target in pattern.findall(code_free):
                    self.links.append((number, target))
            ref = REF_DEF.match(code_free)
            if ref:
                self.links.append((number, ref.group(1)))


class Checker:
    def __init__(self):
        self.pages = {}
        self.problems = []
        self.checked = 0

    def page(self, path):
        path = os.path.normpath(path)
        if path not in self.pages:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                self.pages[path] = e
                return e
            if path.endswith((".html", ".htm")):
                page = HtmlPage()
                page.feed(text)
                page.close()
            else:
                page = MarkdownPage(text)
            self.pages[path] = page
        return self.pages[path]

    def problem(self, path, line, link, why):
        self.problems.append(f"{path}:{line}: {link}: {why}")

    def check_file(self, path, root):
        page = self.page(path)
        if isinstance(page, Exception):
            self.problem(path, 0, "", f"cannot read: {page}")
            return
        for line, link in page.links:
            self.checked += 1
            self.check_link(path, root, line, link)

    def check_link(self, path, root, line, link):
        link = link.strip()
        if not link:
            self.problem(path, line, '""', "empty link")
            return
        lower = link.lower()
        if lower.startswith(SKIPPED_SCHEMES):
            return
        if lower.startswith(("http://", "https://", "//")):
            parts = urllib.parse.urlsplit(link if not link.startswith("//") else "https:" + link)
            if not parts.netloc or re.search(r"\s", link):
                self.problem(path, line, link, "not a well-formed http(s) address")
            return
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link):
            self.problem(path, line, link, "a scheme other than http(s), mailto, javascript or data")
            return
        target, _, fragment = link.partition("#")
        target = urllib.parse.unquote(target.split("?", 1)[0])
        fragment = urllib.parse.unquote(fragment)
        if target == "":
            resolved = os.path.normpath(path)
        elif target.startswith("/"):
            resolved = os.path.normpath(os.path.join(root, target.lstrip("/")))
        else:
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
        if os.path.isdir(resolved):
            if not fragment:
                return
            index = os.path.join(resolved, "index.html")
            if not os.path.isfile(index):
                self.problem(path, line, link, "an anchor into a folder without index.html")
                return
            resolved = index
        if not os.path.exists(resolved):
            self.problem(path, line, link, f"no such file ({resolved})")
            return
        if not fragment:
            return
        if not resolved.endswith((".html", ".htm", ".md", ".markdown")):
            self.problem(path, line, link, "an anchor into a file that is neither HTML nor Markdown")
            return
        page = self.page(resolved)
        if isinstance(page, Exception):
            self.problem(path, line, link, f"cannot read {resolved}: {page}")
        elif fragment not in page.ids:
            self.problem(path, line, link, f"no anchor #{fragment} in {resolved}")


def files_of(arg):
    if os.path.isdir(arg):
        found = []
        for folder, _, names in os.walk(arg):
            for name in sorted(names):
                if name.endswith((".html", ".htm", ".md")):
                    found.append(os.path.join(folder, name))
        return sorted(found), arg
    return [arg], os.path.dirname(arg) or "."


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    checker = Checker()
    count = 0
    for arg in argv[1:]:
        if not os.path.exists(arg):
            print(f"check-links: {arg}: no such file or folder", file=sys.stderr)
            return 2
        files, root = files_of(arg)
        for f in files:
            checker.check_file(f, root)
            count += 1
    if checker.problems:
        print(f"check-links: {len(checker.problems)} broken link(s) in {count} file(s):")
        for p in checker.problems:
            print("  " + p)
        return 1
    print(f"check-links: {count} file(s), {checker.checked} link(s), every one resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
