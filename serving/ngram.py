"""N-gram drafts: proposals copied from the text seen so far, at no model cost.

The longest suffix of the committed tokens (up to `longest` tokens, at least `shortest`) that
occurred before is looked up in an index of every n-gram seen (prompt and generated text alike),
and the tokens that followed its most recent earlier occurrences are proposed. transformers'
prompt lookup (`prompt_lookup_num_tokens`) copies one continuation of the first occurrence of a
2-gram; here the longest match wins, recent before old, and up to `branches` different
continuations are merged into a trie that one target forward verifies. A step costs microseconds
of Python, so where nothing matches the loop is plain decoding.

With `earlier` (suffix decoding across requests: another NgramDrafts holding the prompts and
answers of a session's earlier requests), a suffix of 2+ tokens also matches there, after the
matches of the same length in the request's own text.
"""

from __future__ import annotations


class NgramDrafts:
    def __init__(self, tokens: list[int], shortest: int = 1, longest: int = 4, earlier: NgramDrafts | None = None):
        self.shortest, self.longest = shortest, longest
        self.earlier = earlier
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions it ended at, ascending
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Commit `tokens` (the accepted drafts and the bonus token) to the text and the index."""
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n in range(1, min(self.longest, end + 1) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n + 1 :]), []).append(end)

    def propose(self, length: int, branches: int = 1) -> tuple[list[int], list[int], int]:
        """Up to `branches` continuations of at most `length` tokens each, merged into a trie:
        (tokens, parents, match). Node i (from 1) holds tokens[i-1] below node parents[i-1]; node 0
        is the last committed token. The match is the first continuation's suffix length, negated
        for a match in `earlier` (the schedule counts the two apart); 0: nothing matched, no drafts."""
        end = len(self.tokens) - 1
        found: list[list[int]] = []
        matched = 0
        for n in range(min(self.longest, end), self.shortest - 1, -1):
            suffix = tuple(self.tokens[end - n + 1 :])
            sources = [(self, self.ends.get(suffix, [])[:-1], n)]  # the last end is the suffix itself
            if self.earlier and n >= 2:  # one token recurs everywhere in a long history
                sources.append((self.earlier, self.earlier.ends.get(suffix, []), -n))
            for text, ends, key in sources:
                for position in reversed(ends):
                    continuation = text.tokens[position + 1 : position + 1 + length]
                    if continuation and continuation not in found:
                        found.append(continuation)
                        matched = matched or key
                    if len(found) == branches:
                        break
                if len(found) == branches:
                    break
            if len(found) == branches:
                break
        tokens: list[int] = []
        parents: list[int] = []
        node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for continuation in found:
            node = 0
            for token in continuation:
                if (node, token) not in node_of:
                    tokens.append(token)
                    parents.append(node)
                    node_of[node, token] = len(tokens)
                node = node_of[node, token]
        return tokens, parents, matched


def merge(tokens: list[int], parents: list[int], extra_tokens: list[int], extra_parents: list[int]):
    """The tree (tokens, parents) with the tree (extra_tokens, extra_parents) grafted onto the same
    root, shared prefixes merged: (tokens, parents) in topological order, node numbering as in
    NgramDrafts.propose."""
    tokens, parents = list(tokens), list(parents)
    node_of = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens), 1)}
    placed = [0]  # extra node j -> its node in the merged tree
    for token, parent in zip(extra_tokens, extra_parents):
        key = (placed[parent], token)
        if key not in node_of:
            tokens.append(token)
            parents.append(placed[parent])
            node_of[key] = len(tokens)
        placed.append(node_of[key])
    return tokens, parents
