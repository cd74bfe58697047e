// Bounds on GBNF grammars, checked before llama.cpp builds a grammar sampler, and a
// checked accept for grammar samplers.
//
// What llama.cpp's grammar code does with a hostile grammar (src/llama-grammar.cpp):
// - llama_grammar_parser recurses once per nesting level of ( ... ): deep nesting
//   overflows the C stack (SIGSEGV);
// - llama_grammar_detect_left_recursion recurses along leftmost rule references
//   without memoising finished rules: a chain of rules overflows the stack, a
//   diamond of rules takes exponential time;
// - it counts a rule as empty only when an alternative has no element at all, so a
//   rule that reaches itself through rules that *match* the empty string (x ::= y x "b",
//   y ::= z, z ::= "" | "a") passes the check, and llama_grammar_advance_stack then
//   pushes stack after stack without end (memory grows until the process dies);
// - the number of stacks one advance produces multiplies along nested optional rules
//   ("a"{0,1000} referenced by a rule repeated {0,1000} times: a million stacks of
//   thousands of pointers, gigabytes from a short grammar).
// pyspec_grammar_check parses the grammar with llama.cpp's own parser after bounding
// the nesting, then refuses left recursion through nullable rules, bounds the work of
// the left-recursion check, and bounds the stacks any single advance can produce.
//
// Accepting a token that the grammar does not allow throws a C++ exception through
// the C API (the process ends) or hits GGML_ABORT (end of generation where the
// grammar is not complete); pyspec_grammar_accept_check says beforehand, without
// changing the sampler.

#include "llama.h"
#include "llama-grammar.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

extern "C" {
#include "../pyspec/decl/pyspec_ext.h"
}
#include "pyspec_errbuf.h"

namespace {

using pyspec::fail;

// parse_sequence computes the optional copies of S{m,n} as n - m in uint64: with m > n that
// wraps, and it generates rules until memory runs out (found by scripts/fuzz.py)
bool bad_repetition(const char * s, size_t len, size_t i, std::string & what) {
    auto skip_ws = [&](size_t k) {
        while (k < len && (s[k] == ' ' || s[k] == '\t' || s[k] == '\n' || s[k] == '\r')) {
            ++k;
        }
        return k;
    };
    auto number = [&](size_t & k, unsigned long long & v) {
        const size_t start = k;
        v = 0;
        while (k < len && s[k] >= '0' && s[k] <= '9') {
            v = v > 100000000000ULL ? v : v * 10 + (unsigned long long) (s[k] - '0');
            ++k;
        }
        return k > start;
    };
    size_t k = skip_ws(i + 1);
    unsigned long long lo = 0, hi = 0;
    if (!number(k, lo)) {
        return false;  // the parser reports it
    }
    k = skip_ws(k);
    if (k >= len || s[k] != ',') {
        return false;
    }
    k = skip_ws(k + 1);
    if (!number(k, hi)) {
        return false;
    }
    if (hi < lo) {
        what = "{" + std::to_string(lo) + "," + std::to_string(hi) + "}";
        return true;
    }
    return false;
}

// the deepest nesting of ( ... ) outside literals, character classes, tokens and comments;
// -1 when a repetition {m,n} has m > n
long max_nesting(const char * s, size_t len, std::string & bad) {
    size_t depth = 0, deepest = 0;
    for (size_t i = 0; i < len; ++i) {
        const char c = s[i];
        if (c == '{' && bad_repetition(s, len, i, bad)) {
            return -1;
        }
        if (c == '#') {
            while (i < len && s[i] != '\n' && s[i] != '\r') {
                ++i;
            }
        } else if (c == '"' || c == '[') {
            const char close = c == '"' ? '"' : ']';
            for (++i; i < len && s[i] != close; ++i) {
                if (s[i] == '\\') {
                    ++i;
                }
            }
        } else if (c == '<') {
            while (i < len && s[i] != '>') {
                ++i;
            }
        } else if (c == '(') {
            deepest = std::max(deepest, ++depth);
        } else if (c == ')' && depth > 0) {
            --depth;
        }
    }
    return (long) deepest;
}

bool is_end(const llama_grammar_element & e) {
    return e.type == LLAMA_GRETYPE_END || e.type == LLAMA_GRETYPE_ALT;
}

// the start index of every alternative of a rule
std::vector<size_t> alt_starts(const llama_grammar_rule & rule) {
    std::vector<size_t> out = {0};
    for (size_t i = 0; i < rule.size(); ++i) {
        if (rule[i].type == LLAMA_GRETYPE_ALT) {
            out.push_back(i + 1);
        }
    }
    return out;
}

struct analysis {
    const llama_grammar_rules & rules;
    std::vector<std::vector<size_t>> alts;
    std::vector<bool> nullable;

    explicit analysis(const llama_grammar_rules & r) : rules(r) {
        alts.reserve(rules.size());
        for (const auto & rule : rules) {
            alts.push_back(alt_starts(rule));
        }
        compute_nullable();
    }

    // rules that can match the empty string (fixpoint; terminals never can)
    void compute_nullable() {
        nullable.assign(rules.size(), false);
        bool changed = true;
        while (changed) {
            changed = false;
            for (size_t r = 0; r < rules.size(); ++r) {
                if (nullable[r]) {
                    continue;
                }
                for (size_t a : alts[r]) {
                    bool all = true;
                    for (size_t i = a; i < rules[r].size() && !is_end(rules[r][i]); ++i) {
                        const auto & e = rules[r][i];
                        if (e.type != LLAMA_GRETYPE_RULE_REF || !nullable[e.value]) {
                            all = false;
                            break;
                        }
                    }
                    if (all) {
                        nullable[r] = changed = true;
                        break;
                    }
                }
            }
        }
    }

    // rules reachable from r through references preceded only by elements that `skip` lets through
    template <typename Skip>
    std::vector<uint32_t> leftmost(size_t r, Skip skip) const {
        std::vector<uint32_t> out;
        for (size_t a : alts[r]) {
            for (size_t i = a; i < rules[r].size() && !is_end(rules[r][i]); ++i) {
                const auto & e = rules[r][i];
                if (e.type != LLAMA_GRETYPE_RULE_REF) {
                    break;
                }
                out.push_back(e.value);
                if (!skip(e.value)) {
                    break;
                }
            }
        }
        return out;
    }
};

}  // namespace

extern "C" {

int pyspec_grammar_check(const struct llama_vocab * vocab, const char * text, size_t len, const char * root) {
    if (text == nullptr || root == nullptr) {
        return fail(-1, "grammar or root is NULL");
    }
    if (len > PYSPEC_GRAMMAR_MAX_BYTES) {
        return fail(-1, "grammar of %zu bytes exceeds the limit of %d bytes", len, (int) PYSPEC_GRAMMAR_MAX_BYTES);
    }
    if (std::memchr(text, '\0', len) != nullptr) {
        return fail(-1, "grammar contains a NUL character");
    }
    std::string bad;
    const long nesting = max_nesting(text, len, bad);
    if (nesting < 0) {
        return fail(-1, "repetition %s has a minimum above its maximum", bad.c_str());
    }
    if (nesting > PYSPEC_GRAMMAR_MAX_NESTING) {
        return fail(-1, "grammar nests ( ... ) %ld deep, more than %d", nesting, (int) PYSPEC_GRAMMAR_MAX_NESTING);
    }
    try {
        const std::string src(text, len);
        llama_grammar_parser parser(vocab);
        if (!parser.parse(src.c_str()) || parser.rules.empty()) {
            return fail(-1, "failed to parse the grammar");
        }
        if (parser.symbol_ids.find(root) == parser.symbol_ids.end()) {
            return fail(-1, "the grammar has no rule named '%s'", root);
        }
        const auto & rules = parser.rules;
        size_t n_elements = 0;
        for (const auto & rule : rules) {
            n_elements += rule.size();
        }
        if (n_elements > PYSPEC_GRAMMAR_MAX_ELEMENTS) {
            return fail(-1, "the grammar expands to %zu elements, more than %d", n_elements,
                        (int) PYSPEC_GRAMMAR_MAX_ELEMENTS);
        }
        analysis an(rules);
        const size_t n = rules.size();

        // 1. no rule may reach itself through rules that can match the empty string
        //    (llama_grammar_advance_stack would push stacks forever); iterative DFS
        {
            std::vector<std::vector<uint32_t>> edges(n);
            for (size_t r = 0; r < n; ++r) {
                edges[r] = an.leftmost(r, [&](uint32_t s) { return (bool) an.nullable[s]; });
            }
            std::vector<uint8_t> color(n, 0);  // 0 new, 1 on the path, 2 done
            std::vector<std::pair<uint32_t, size_t>> path;
            for (size_t s = 0; s < n; ++s) {
                if (color[s] != 0) {
                    continue;
                }
                path.emplace_back((uint32_t) s, 0);
                color[s] = 1;
                while (!path.empty()) {
                    auto & [r, k] = path.back();
                    if (k < edges[r].size()) {
                        const uint32_t c = edges[r][k++];
                        if (color[c] == 1) {
                            return fail(-1,
                                        "the grammar is left-recursive (a rule reaches itself through rules that can match "
                                        "the empty string)");
                        }
                        if (color[c] == 0) {
                            color[c] = 1;
                            path.emplace_back(c, 0);
                        }
                    } else {
                        color[r] = 2;
                        path.pop_back();
                    }
                }
            }
        }

        // 2. the work and depth of llama_grammar_detect_left_recursion, which follows a leftmost
        //    reference past a rule only when it has an empty alternative, and revisits rules
        {
            auto has_empty_alt = [&](uint32_t s) {
                for (size_t a : an.alts[s]) {
                    if (a < rules[s].size() && is_end(rules[s][a])) {
                        return true;
                    }
                }
                return false;
            };
            std::vector<std::vector<uint32_t>> edges(n);
            for (size_t r = 0; r < n; ++r) {
                edges[r] = an.leftmost(r, has_empty_alt);
            }
            // the graph is acyclic now (its edges are a subset of those checked above): post-order DP
            std::vector<double> calls(n, 0.0), depth(n, 0.0);
            std::vector<uint8_t> done(n, 0);
            std::vector<std::pair<uint32_t, size_t>> path;
            double total = 0.0;
            for (size_t s = 0; s < n; ++s) {
                if (!done[s]) {
                    path.emplace_back((uint32_t) s, 0);
                    while (!path.empty()) {
                        auto & [r, k] = path.back();
                        if (k < edges[r].size()) {
                            const uint32_t c = edges[r][k++];
                            if (!done[c]) {
                                path.emplace_back(c, 0);
                            }
                        } else {
                            double w = 1.0, d = 0.0;
                            for (uint32_t c : edges[r]) {
                                w += calls[c];
                                d = std::max(d, depth[c]);
                            }
                            calls[r] = std::min(w, 1e300);
                            depth[r] = d + 1.0;
                            done[r] = 1;
                            path.pop_back();
                        }
                    }
                }
                total = std::min(total + calls[s], 1e300);
                if (depth[s] > PYSPEC_GRAMMAR_MAX_DEPTH) {
                    return fail(-1, "the grammar chains %.0f rules at the start of a rule, more than %d",
                                depth[s], (int) PYSPEC_GRAMMAR_MAX_DEPTH);
                }
            }
            if (total > PYSPEC_GRAMMAR_MAX_STEPS) {
                return fail(-1, "checking the grammar for left recursion would take %.3g steps, more than %d",
                            total, (int) PYSPEC_GRAMMAR_MAX_STEPS);
            }
        }

        // 3. the stacks one llama_grammar_advance_stack can produce from a stack whose top is
        //    element (r, i): terminal stacks t, and whether it can pass through to the element
        //    below (identical stacks are merged there, so a pass counts once). A reference needs
        //    its rule's alternatives, and the element after it only when some alternative passes;
        //    after check 1 these dependencies form no cycle.
        {
            enum : uint8_t { NEW, WAIT_ALTS, WAIT_NEXT, DONE };
            std::vector<std::vector<double>> t(n);
            std::vector<std::vector<uint8_t>> pass(n), state(n);
            for (size_t r = 0; r < n; ++r) {
                t[r].assign(rules[r].size(), 0.0);
                pass[r].assign(rules[r].size(), 0);
                state[r].assign(rules[r].size(), NEW);
            }
            std::vector<std::pair<uint32_t, uint32_t>> todo;
            bool cycle = false;
            auto push = [&](uint32_t r, uint32_t i) {
                if (state[r][i] == WAIT_ALTS || state[r][i] == WAIT_NEXT) {
                    cycle = true;
                } else if (state[r][i] == NEW) {
                    todo.emplace_back(r, i);
                }
            };
            double worst = 0.0;
            for (uint32_t r0 = 0; r0 < n && !cycle; ++r0) {
                for (uint32_t i0 = 0; i0 < rules[r0].size() && !cycle; ++i0) {
                    push(r0, i0);
                    while (!todo.empty() && !cycle) {
                        const auto [r, i] = todo.back();
                        const auto & e = rules[r][i];
                        if (state[r][i] == DONE) {
                            todo.pop_back();
                            continue;
                        }
                        if (is_end(e) || e.type != LLAMA_GRETYPE_RULE_REF) {
                            t[r][i] = is_end(e) ? 0.0 : 1.0;
                            pass[r][i] = is_end(e);
                            state[r][i] = DONE;
                            todo.pop_back();
                            continue;
                        }
                        const uint32_t target = e.value;
                        if (state[r][i] == NEW) {
                            state[r][i] = WAIT_ALTS;
                            const size_t before = todo.size();
                            for (size_t a : an.alts[target]) {
                                push(target, (uint32_t) a);
                            }
                            if (todo.size() != before) {
                                continue;
                            }
                        }
                        double terms = 0.0;
                        bool any_pass = false;
                        for (size_t a : an.alts[target]) {
                            terms += t[target][a];
                            any_pass = any_pass || pass[target][a];
                        }
                        const bool next_is_end = i + 1 >= rules[r].size() || is_end(rules[r][i + 1]);
                        if (any_pass && !next_is_end && state[r][i + 1] != DONE) {
                            if (state[r][i] == WAIT_NEXT) {
                                cycle = true;
                                break;
                            }
                            state[r][i] = WAIT_NEXT;
                            push(r, i + 1);
                            continue;
                        }
                        double tr = terms;
                        bool pr = any_pass;
                        if (any_pass && !next_is_end) {
                            tr += t[r][i + 1];
                            pr = pass[r][i + 1];
                        }
                        t[r][i] = std::min(tr, 1e300);
                        pass[r][i] = pr;
                        state[r][i] = DONE;
                        worst = std::max(worst, t[r][i]);
                        todo.pop_back();
                    }
                }
            }
            if (cycle) {
                return fail(-1, "the grammar is left-recursive through rules that can match the empty string");
            }
            if (worst > PYSPEC_GRAMMAR_MAX_STACKS) {
                return fail(-1,
                            "one step of the grammar can branch into %.3g parse stacks, more than %d "
                            "(nested optional or repeated rules multiply)", worst, (int) PYSPEC_GRAMMAR_MAX_STACKS);
            }
        }
    } catch (const std::exception & e) {
        return fail(-1, "%s", e.what());
    }
    return 0;
}

}  // extern "C"

namespace {

// struct llama_sampler_grammar is private to src/llama-sampler.cpp; at this revision
// (e3a74b299) it is {vocab, grammar_str, grammar_root, grammar}. This mirror reaches the
// llama_grammar (a public struct of src/llama-grammar.h) of a sampler named "grammar".
struct sampler_grammar_mirror {
    const llama_vocab * vocab;
    std::string grammar_str;
    std::string grammar_root;
    llama_grammar * grammar;
};

llama_grammar * grammar_of(llama_sampler * smpl) {
    if (smpl == nullptr || smpl->iface == nullptr || smpl->ctx == nullptr ||
        std::strcmp(llama_sampler_name(smpl), "grammar") != 0) {
        return nullptr;
    }
    return static_cast<sampler_grammar_mirror *>(smpl->ctx)->grammar;
}

}  // namespace

extern "C" {

int64_t pyspec_grammar_n_stacks(struct llama_sampler * smpl) {
    llama_grammar * g = grammar_of(smpl);
    return g == nullptr ? -1 : (int64_t) g->stacks.size();
}

int pyspec_grammar_accept_check(struct llama_sampler * smpl, const struct llama_vocab * vocab, llama_token token) {
    llama_grammar * g = grammar_of(smpl);
    if (g == nullptr || vocab == nullptr) {
        return 0;  // not a grammar sampler (or one without a grammar): nothing to check
    }
    if (token < 0 || token >= llama_vocab_n_tokens(vocab)) {
        return fail(-1, "token %d is outside the vocabulary (0..%d)", (int) token, llama_vocab_n_tokens(vocab) - 1);
    }
    if (g->awaiting_trigger) {
        return 0;  // a lazy grammar buffers tokens until its trigger
    }
    if (llama_vocab_is_eog(vocab, token)) {
        // llama_grammar_accept_impl: GGML_ABORT unless some stack is complete
        for (const auto & stack : g->stacks) {
            if (stack.empty()) {
                return 0;
            }
        }
        return fail(-1, "the grammar does not allow end of generation here (token %d)", (int) token);
    }
    // accept on the real grammar, then put its state back: exact, and costs one copy of the stacks
    llama_grammar_stacks saved = g->stacks;
    const llama_partial_utf8 saved_utf8 = g->partial_utf8;
    int rc = 0;
    try {
        llama_grammar_accept_impl(*g, token);
        if (g->stacks.size() > (size_t) PYSPEC_GRAMMAR_MAX_STACKS) {
            rc = fail(-1, "accepting token %d would leave %zu parse stacks in the grammar, more than %d",
                      (int) token, g->stacks.size(), (int) PYSPEC_GRAMMAR_MAX_STACKS);
        }
    } catch (const std::exception & e) {
        rc = fail(-1, "%s", e.what());
    }
    g->stacks = std::move(saved);
    g->partial_utf8 = saved_utf8;
    return rc;
}

}  // extern "C"
