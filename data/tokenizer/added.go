package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// addedToken is an entry of tokenizer.json's added_tokens.
type addedToken struct {
	ID         int32  `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

// matcher finds added tokens in text with the semantics of HF tokenizers'
// AddedVocabulary: non-overlapping leftmost-longest matches (its
// Aho-Corasick automaton), then single_word filtering and lstrip/rstrip
// widening of each match. The token sets of real models are small and begin
// with few distinct bytes, so candidates are indexed by first byte.
type matcher struct {
	byFirst [256][]int // indexes into toks, longest content first
	toks    []addedToken
	pattern []string // what is matched (content, or its normalized form)
}

func newMatcher(toks []addedToken, pattern []string) *matcher {
	if len(toks) == 0 {
		return nil
	}
	m := &matcher{toks: toks, pattern: pattern}
	for i, p := range pattern {
		if p == "" {
			continue
		}
		b := p[0]
		lst := m.byFirst[b]
		j := len(lst)
		for j > 0 && len(pattern[lst[j-1]]) < len(p) {
			j--
		}
		lst = append(lst, 0)
		copy(lst[j+1:], lst[j:])
		lst[j] = i
		m.byFirst[b] = lst
	}
	return m
}

// span is a piece of a section: either plain text to tokenize (tok < 0) or
// one added token.
type span struct {
	start, end int
	tok        int // index into matcher.toks, or -1
}

// split cuts s into plain and added-token spans, appending them to out.
func (m *matcher) split(s string, out []span) []span {
	if m == nil || len(s) == 0 {
		if len(s) > 0 {
			out = append(out, span{0, len(s), -1})
		}
		return out
	}
	startOffset := 0
	for i := 0; i < len(s); {
		cands := m.byFirst[s[i]]
		hit := -1
		for _, c := range cands {
			p := m.pattern[c]
			if len(p) <= len(s)-i && s[i:i+len(p)] == p {
				hit = c
				break
			}
		}
		if hit < 0 {
			i++
			continue
		}
		start, stop := i, i+len(m.pattern[hit])
		i = stop // the automaton resumes after a match even if it is discarded below
		t := &m.toks[hit]
		if t.SingleWord {
			startSpace := start == 0 || !endsWithWord(s[:start])
			stopSpace := stop == len(s) || !startsWithWord(s[stop:])
			if !startSpace || !stopSpace {
				continue
			}
		}
		if t.LStrip {
			start = max(trimRightSpace(s[:start]), startOffset)
		}
		if t.RStrip {
			stop += len(s[stop:]) - len(trimLeftSpace(s[stop:]))
			i = stop
		}
		if startOffset < start {
			out = append(out, span{startOffset, start, -1})
		}
		out = append(out, span{start, stop, hit})
		startOffset = stop
	}
	if startOffset < len(s) {
		out = append(out, span{startOffset, len(s), -1})
	}
	return out
}

// isWordRune is the Unicode \w of Rust's regex crate, which HF tokenizers
// uses for single_word: Alphabetic, marks, decimal digits, connector
// punctuation and the join controls.
func isWordRune(r rune) bool {
	return unicode.IsLetter(r) || unicode.Is(unicode.Nl, r) || unicode.Is(unicode.Other_Alphabetic, r) ||
		unicode.IsMark(r) || unicode.Is(unicode.Nd, r) || unicode.Is(unicode.Pc, r) ||
		r == 0x200C || r == 0x200D
}

func endsWithWord(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return isWordRune(r)
}

func startsWithWord(s string) bool {
	r, _ := utf8.DecodeRuneInString(s)
	return isWordRune(r)
}

// trimRightSpace returns the start of the trailing White_Space run of s.
func trimRightSpace(s string) int {
	for len(s) > 0 {
		r, n := utf8.DecodeLastRuneInString(s)
		if !unicode.Is(unicode.White_Space, r) {
			break
		}
		s = s[:len(s)-n]
	}
	return len(s)
}

func trimLeftSpace(s string) string {
	for len(s) > 0 {
		r, n := utf8.DecodeRuneInString(s)
		if !unicode.Is(unicode.White_Space, r) {
			break
		}
		s = s[n:]
	}
	return s
}
