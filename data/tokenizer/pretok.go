package tokenizer

import (
	"sync"
	"unicode"
	"unicode/utf8"
)

// The Split pre-tokenizers of the supported models are regexes with a
// lookahead (`\s+(?!\S)`), which Go's regexp cannot express. Each known
// pattern is therefore a hand-written scanner that returns, for a start
// position, the end of the match that Oniguruma (the engine HF tokenizers
// uses) would report there: alternatives are tried left to right, each
// quantifier is greedy and backtracks. For these patterns every position
// starts a non-empty match, so the splits tile the text and Split's
// "Isolated" behaviour is simply the sequence of matches.
//
// Character classes follow Oniguruma's Unicode semantics: \p{L} and \p{N} are
// general categories, \s is White_Space (U+0009..U+000D, U+0020, U+0085,
// U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000; not
// U+FEFF), and (?i:'s) also matches "'ſ" (U+017F folds to s).

// patternKind identifies one of the known pre-tokenizer regexes.
type patternKind int

const (
	// patQwen2 is the Qwen2/Qwen2.5/Qwen3 Split regex (\p{N} one digit at a time).
	patQwen2 patternKind = iota + 1
	// patLlama3 is the Llama 3 Split regex (\p{N}{1,3}).
	patLlama3
	// patGPT2 is the regex of ByteLevel with use_regex=true (GPT-2).
	patGPT2
)

// Known regexes, exactly as they appear in tokenizer.json.
const (
	regexQwen2  = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	regexLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	regexGPT2   = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

func (k patternKind) String() string {
	switch k {
	case patQwen2:
		return "qwen2"
	case patLlama3:
		return "llama3"
	case patGPT2:
		return "gpt2"
	}
	return "unknown"
}

// Character class bits.
const (
	clsL  = 1 << iota // \p{L}
	clsN              // \p{N}
	clsWS             // \s (White_Space)
	clsNL             // \r or \n
)

var (
	bmpOnce  sync.Once
	bmpClass []uint8 // class bits of every rune < 0x10000 (64 KiB, built on first use)
)

func buildBMP() {
	bmpClass = make([]uint8, 0x10000)
	for r := rune(0); r < 0x10000; r++ {
		bmpClass[r] = classSlow(r)
	}
}

func classSlow(r rune) uint8 {
	var c uint8
	if unicode.IsLetter(r) {
		c |= clsL
	}
	if unicode.IsNumber(r) {
		c |= clsN
	}
	if unicode.Is(unicode.White_Space, r) {
		c |= clsWS
	}
	if r == '\r' || r == '\n' {
		c |= clsNL
	}
	return c
}

// classAt decodes the rune at s[i:] and returns its class bits and width.
// Invalid UTF-8 cannot reach here (Encode's input is converted to valid
// UTF-8 first), but a RuneError of width 1 is still handled: it is "other".
func classAt(s string, i int) (uint8, int) {
	c := s[i]
	if c < utf8.RuneSelf {
		return bmpClass[c], 1
	}
	r, n := utf8.DecodeRuneInString(s[i:])
	if r < 0x10000 {
		return bmpClass[r], n
	}
	return classSlow(r), n
}

// splitPreTokens appends to out the end offsets of the consecutive matches of
// the pattern over s (the first starts at 0).
func splitPreTokens(kind patternKind, s string, out []int) []int {
	bmpOnce.Do(buildBMP)
	for i := 0; i < len(s); {
		var e int
		switch kind {
		case patGPT2:
			e = nextGPT2(s, i)
		case patLlama3:
			e = nextSplit(s, i, 3)
		default:
			e = nextSplit(s, i, 1)
		}
		out = append(out, e)
		i = e
	}
	return out
}

// contraction returns the end of `(?i:'s|'t|'re|'ve|'m|'ll|'d)` (or its
// case-sensitive form) at s[i] == '\”, or -1.
func contraction(s string, i int, fold bool) int {
	j := i + 1
	if j >= len(s) {
		return -1
	}
	lower := func(b byte) byte {
		if fold && b >= 'A' && b <= 'Z' {
			return b + 'a' - 'A'
		}
		return b
	}
	switch lower(s[j]) {
	case 's', 't', 'm', 'd':
		return j + 1
	case 'r', 'v':
		if j+1 < len(s) && lower(s[j+1]) == 'e' {
			return j + 2
		}
	case 'l':
		if j+1 < len(s) && lower(s[j+1]) == 'l' {
			return j + 2
		}
	case 0xC5: // U+017F LATIN SMALL LETTER LONG S is C5 BF; it case-folds to 's'.
		if fold && j+1 < len(s) && s[j+1] == 0xBF {
			return j + 2
		}
	}
	return -1
}

// run returns the end of the maximal run, starting at i, of runes whose class
// satisfies want, and the number of runes in it (stopping after max runes when
// max > 0).
func run(s string, i int, want func(uint8) bool, max int) (end, count int) {
	for i < len(s) {
		c, n := classAt(s, i)
		if !want(c) {
			break
		}
		i += n
		count++
		if count == max {
			break
		}
	}
	return i, count
}

func isL(c uint8) bool     { return c&clsL != 0 }
func isN(c uint8) bool     { return c&clsN != 0 }
func isWS(c uint8) bool    { return c&clsWS != 0 }
func isOther(c uint8) bool { return c&(clsL|clsN|clsWS) == 0 }

// nextSplit is the Qwen2 (maxDigits 1) and Llama 3 (maxDigits 3) regex:
//
//	A1 (?i:'s|'t|'re|'ve|'m|'ll|'d)
//	A2 [^\r\n\p{L}\p{N}]?\p{L}+
//	A3 \p{N}{1,maxDigits}
//	A4  ?[^\s\p{L}\p{N}]+[\r\n]*
//	A5 \s*[\r\n]+
//	A6 \s+(?!\S)
//	A7 \s+
func nextSplit(s string, i int, maxDigits int) int {
	c, n := classAt(s, i)
	if s[i] == '\'' {
		if e := contraction(s, i, true); e > 0 {
			return e
		}
	}
	// A2: an optional non-letter, non-digit, non-newline prefix, then letters.
	if isL(c) {
		e, _ := run(s, i, isL, 0)
		return e
	}
	if c&(clsN|clsNL) == 0 && i+n < len(s) {
		if c2, _ := classAt(s, i+n); isL(c2) {
			e, _ := run(s, i+n, isL, 0)
			return e
		}
	}
	// A3
	if isN(c) {
		e, _ := run(s, i, isN, maxDigits)
		return e
	}
	// A4: the optional space only helps when "other" runes follow it.
	j := i
	if s[i] == ' ' {
		j = i + 1
	}
	if e, k := run(s, j, isOther, 0); k > 0 {
		for e < len(s) && (s[e] == '\r' || s[e] == '\n') {
			e++
		}
		return e
	}
	// Here s[i] is white space.
	return nextSpace(s, i, true)
}

// nextSpace matches at white space: A5 (if withNewline) `\s*[\r\n]+`, then
// `\s+(?!\S)`, then `\s+`.
func nextSpace(s string, i int, withNewline bool) int {
	end, lastStart, afterNL, count := i, i, -1, 0
	for end < len(s) {
		c, n := classAt(s, end)
		if !isWS(c) {
			break
		}
		if c&clsNL != 0 {
			afterNL = end + n
		}
		lastStart = end
		end += n
		count++
	}
	// \s* backtracks to the last newline of the run; [\r\n]+ then takes it
	// (the rune after it is not a newline, or the run would continue there).
	if withNewline && afterNL >= 0 {
		return afterNL
	}
	if end == len(s) || count == 1 {
		// (?!\S) holds at the end of text; a single space before \S
		// cannot give one back, so \s+ takes it.
		return end
	}
	// \s+ gives back the last white-space rune so that (?!\S) sees it.
	return lastStart
}

// nextGPT2 is the GPT-2 ByteLevel regex:
//
//	's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
func nextGPT2(s string, i int) int {
	if s[i] == '\'' {
		if e := contraction(s, i, false); e > 0 {
			return e
		}
	}
	j := i
	if s[i] == ' ' && i+1 < len(s) {
		j = i + 1
	}
	c, _ := classAt(s, j)
	switch {
	case isL(c):
		e, _ := run(s, j, isL, 0)
		return e
	case isN(c):
		e, _ := run(s, j, isN, 0)
		return e
	case isOther(c):
		e, _ := run(s, j, isOther, 0)
		return e
	}
	return nextSpace(s, i, false)
}
