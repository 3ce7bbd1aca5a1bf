package chattmpl

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// The lexer reproduces jinja2's (lexer.py) whitespace rules for an
// environment with trim_blocks=True and lstrip_blocks=True, which is what
// transformers uses:
//
//   - source newlines are normalized with str.splitlines semantics and a
//     single trailing newline is dropped (keep_trailing_newline=False);
//   - "{%-", "{{-", "{#-" strip all whitespace before the tag;
//   - "-%}", "-}}", "-#}" strip all whitespace after the tag;
//   - trim_blocks: "%}" and "#}" eat one directly following "\n";
//     "+%}" disables that;
//   - lstrip_blocks: spaces/tabs between the start of a line and "{%" or "{#"
//     are removed ("{%+" disables it); never for "{{".

type tokKind int

const (
	tText tokKind = iota
	tVarBegin
	tVarEnd
	tBlockBegin
	tBlockEnd
	tName
	tString
	tInt
	tFloat
	tOp
	tEOF
)

type token struct {
	kind tokKind
	val  string // text, name, operator, or decoded string literal
	num  any    // int64 or float64 for tInt/tFloat
	line int
}

func (t token) String() string {
	switch t.kind {
	case tText:
		return "template data"
	case tVarBegin:
		return "'{{'"
	case tVarEnd:
		return "'}}'"
	case tBlockBegin:
		return "'{%'"
	case tBlockEnd:
		return "'%}'"
	case tName:
		return "name '" + t.val + "'"
	case tString:
		return "string " + repr(t.val)
	case tInt, tFloat:
		return "number " + toStr(t.num)
	case tOp:
		return "'" + t.val + "'"
	}
	return "end of template"
}

// normalizeNewlines mirrors "\n".join(source.splitlines()): every Python line
// boundary becomes "\n", and one trailing line boundary disappears.
func normalizeNewlines(src string) string {
	var b strings.Builder
	b.Grow(len(src))
	for i := 0; i < len(src); {
		r, n := utf8.DecodeRuneInString(src[i:])
		switch r {
		case '\r':
			if i+1 < len(src) && src[i+1] == '\n' {
				n = 2
			}
			b.WriteByte('\n')
		case '\n', '\v', '\f', 0x1c, 0x1d, 0x1e, 0x85, 0x2028, 0x2029:
			b.WriteByte('\n')
		default:
			b.WriteString(src[i : i+n])
		}
		i += n
	}
	s := b.String()
	return strings.TrimSuffix(s, "\n")
}

type lexer struct {
	src          string
	pos          int
	line         int
	lineStarting bool
	toks         []token
}

func lex(src string) ([]token, error) {
	lx := &lexer{src: normalizeNewlines(src), line: 1, lineStarting: true}
	if err := lx.run(); err != nil {
		return nil, err
	}
	lx.toks = append(lx.toks, token{kind: tEOF, line: lx.line})
	return lx.toks, nil
}

func (lx *lexer) errf(line int, format string, args ...any) error {
	return &Error{Kind: ErrSyntax, Line: line, Msg: fmt.Sprintf(format, args...)}
}

func (lx *lexer) emitText(s string) {
	if s != "" {
		lx.toks = append(lx.toks, token{kind: tText, val: s, line: lx.line})
	}
	lx.line += strings.Count(s, "\n")
}

func (lx *lexer) run() error {
	src := lx.src
	for lx.pos < len(src) {
		i := indexTagStart(src, lx.pos)
		if i < 0 {
			lx.emitText(src[lx.pos:])
			lx.pos = len(src)
			return nil
		}
		kind := src[i+1] // '{', '%' or '#'
		j := i + 2
		sign := byte(0)
		if j < len(src) && (src[j] == '-' || src[j] == '+') {
			sign = src[j]
			j++
		}
		text := src[lx.pos:i]
		skipped := 0 // newlines inside text that we strip away still count for line numbers
		switch {
		case sign == '-':
			st := strings.TrimRightFunc(text, isSpace)
			skipped = strings.Count(text[len(st):], "\n")
			text = st
		case sign != '+' && kind != '{':
			lpos := strings.LastIndexByte(text, '\n') + 1
			if (lpos > 0 || lx.lineStarting) && lpos < len(text) && strings.TrimLeftFunc(text[lpos:], isSpace) == "" {
				text = text[:lpos]
			}
		}
		lx.emitText(text)
		lx.line += skipped
		lx.pos = j
		var err error
		switch kind {
		case '#':
			err = lx.comment(i)
		case '%':
			if end, ok := lx.rawBlock(i, j); ok {
				lx.pos = end
				continue
			}
			err = lx.tag(tBlockBegin, tBlockEnd)
		case '{':
			err = lx.tag(tVarBegin, tVarEnd)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// indexTagStart finds the next "{{", "{%" or "{#" at or after pos.
func indexTagStart(s string, pos int) int {
	for {
		k := strings.IndexByte(s[pos:], '{')
		if k < 0 || pos+k+1 >= len(s) {
			return -1
		}
		c := s[pos+k+1]
		if c == '{' || c == '%' || c == '#' {
			return pos + k
		}
		pos += k + 1
	}
}

func (lx *lexer) comment(start int) error {
	src := lx.src
	k := strings.Index(src[lx.pos:], "#}")
	if k < 0 {
		return lx.errf(lx.line, "missing end of comment tag: the '{#' opened here is never closed with '#}'")
	}
	e := lx.pos + k
	body := src[lx.pos:e]
	end := e + 2
	switch {
	case strings.HasSuffix(body, "-"):
		for end < len(src) {
			r, n := utf8.DecodeRuneInString(src[end:])
			if !isSpace(r) {
				break
			}
			end += n
		}
	case strings.HasSuffix(body, "+"):
	default:
		if end < len(src) && src[end] == '\n' {
			end++
		}
	}
	lx.line += strings.Count(src[start:end], "\n")
	lx.lineStarting = src[end-1] == '\n'
	lx.pos = end
	return nil
}

// rawBlock handles {% raw %}...{% endraw %}: its body is emitted verbatim.
func (lx *lexer) rawBlock(start, j int) (int, bool) {
	src := lx.src
	p := j
	for p < len(src) && isSpace(rune(src[p])) {
		p++
	}
	if !strings.HasPrefix(src[p:], "raw") {
		return 0, false
	}
	p += 3
	for p < len(src) && isSpace(rune(src[p])) {
		p++
	}
	if p < len(src) && (src[p] == '-' || src[p] == '+') {
		p++
	}
	if !strings.HasPrefix(src[p:], "%}") {
		return 0, false
	}
	p += 2
	if src[p-3] == '-' {
		for p < len(src) && isSpace(rune(src[p])) {
			p++
		}
	} else if src[p-3] != '+' && p < len(src) && src[p] == '\n' {
		p++
	}
	// Find {%[-+]? endraw [-+]?%}.
	q := p
	for {
		k := strings.Index(src[q:], "{%")
		if k < 0 {
			return 0, false
		}
		a := q + k
		b := a + 2
		strip := false
		if b < len(src) && (src[b] == '-' || src[b] == '+') {
			strip = src[b] == '-'
			b++
		}
		for b < len(src) && isSpace(rune(src[b])) {
			b++
		}
		if !strings.HasPrefix(src[b:], "endraw") {
			q = a + 2
			continue
		}
		b += 6
		for b < len(src) && isSpace(rune(src[b])) {
			b++
		}
		endSign := byte(0)
		if b < len(src) && (src[b] == '-' || src[b] == '+') {
			endSign = src[b]
			b++
		}
		if !strings.HasPrefix(src[b:], "%}") {
			q = a + 2
			continue
		}
		b += 2
		body := src[p:a]
		if strip {
			body = strings.TrimRightFunc(body, isSpace)
		} else if endSign != '+' {
			lpos := strings.LastIndexByte(body, '\n') + 1
			if lpos < len(body) && strings.TrimLeftFunc(body[lpos:], isSpace) == "" {
				body = body[:lpos]
			}
		}
		if endSign == '-' {
			for b < len(src) && isSpace(rune(src[b])) {
				b++
			}
		} else if endSign != '+' && b < len(src) && src[b] == '\n' {
			b++
		}
		lx.line += strings.Count(src[start:p], "\n")
		lx.emitText(body)
		lx.line += strings.Count(src[a:b], "\n")
		lx.lineStarting = src[b-1] == '\n'
		return b, true
	}
}

var operators3 = []string{"**", "//", "==", "!=", ">=", "<="}

const operators1 = "+-/*%~[](){}><=.:|,;"

// tag lexes the inside of {% ... %} or {{ ... }}.
func (lx *lexer) tag(begin, endKind tokKind) error {
	src := lx.src
	startLine := lx.line
	lx.toks = append(lx.toks, token{kind: begin, line: lx.line})
	var stack []byte // open brackets: jinja2 ignores end delimiters while any is open
	for {
		// whitespace
		for lx.pos < len(src) {
			r, n := utf8.DecodeRuneInString(src[lx.pos:])
			if !isSpace(r) {
				break
			}
			if r == '\n' {
				lx.line++
			}
			lx.pos += n
		}
		if lx.pos >= len(src) {
			what := "'%}'"
			if endKind == tVarEnd {
				what = "'}}'"
			}
			return lx.errf(startLine, "unexpected end of template: tag opened on line %d is never closed with %s", startLine, what)
		}
		rest := src[lx.pos:]
		if len(stack) == 0 {
			end, n := -1, 0
			if endKind == tBlockEnd {
				switch {
				case strings.HasPrefix(rest, "-%}"):
					end, n = 3, 3
					for end < len(rest) {
						r, w := utf8.DecodeRuneInString(rest[end:])
						if !isSpace(r) {
							break
						}
						end += w
					}
				case strings.HasPrefix(rest, "+%}"):
					end, n = 3, 3
				case strings.HasPrefix(rest, "%}"):
					end, n = 2, 2
					if len(rest) > 2 && rest[2] == '\n' {
						end = 3
					}
				}
			} else {
				switch {
				case strings.HasPrefix(rest, "-}}"):
					end, n = 3, 3
					for end < len(rest) {
						r, w := utf8.DecodeRuneInString(rest[end:])
						if !isSpace(r) {
							break
						}
						end += w
					}
				case strings.HasPrefix(rest, "}}"):
					end, n = 2, 2
				}
			}
			if end >= 0 {
				_ = n
				lx.toks = append(lx.toks, token{kind: endKind, line: lx.line})
				lx.line += strings.Count(rest[:end], "\n")
				lx.pos += end
				lx.lineStarting = rest[end-1] == '\n'
				return nil
			}
		}
		c := rest[0]
		switch {
		case c >= '0' && c <= '9':
			if err := lx.number(); err != nil {
				return err
			}
		case c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= 0x80:
			n := 0
			for n < len(rest) {
				r, w := utf8.DecodeRuneInString(rest[n:])
				if !(r == '_' || unicode.IsLetter(r) || (n > 0 && unicode.IsDigit(r))) {
					break
				}
				n += w
			}
			if n == 0 {
				r, _ := utf8.DecodeRuneInString(rest)
				return lx.errf(lx.line, "unexpected character %q inside a tag", r)
			}
			lx.toks = append(lx.toks, token{kind: tName, val: rest[:n], line: lx.line})
			lx.pos += n
		case c == '\'' || c == '"':
			if err := lx.str(c); err != nil {
				return err
			}
		default:
			op := ""
			for _, o := range operators3 {
				if strings.HasPrefix(rest, o) {
					op = o
					break
				}
			}
			if op == "" && strings.IndexByte(operators1, c) >= 0 {
				op = rest[:1]
			}
			if op == "" {
				r, _ := utf8.DecodeRuneInString(rest)
				return lx.errf(lx.line, "unexpected character %q inside a tag", r)
			}
			switch op {
			case "(", "[", "{":
				stack = append(stack, op[0])
			case ")", "]", "}":
				want := map[byte]byte{')': '(', ']': '[', '}': '{'}[op[0]]
				if len(stack) == 0 || stack[len(stack)-1] != want {
					return lx.errf(lx.line, "unexpected '%s'", op)
				}
				stack = stack[:len(stack)-1]
			}
			lx.toks = append(lx.toks, token{kind: tOp, val: op, line: lx.line})
			lx.pos += len(op)
		}
	}
}

// number lexes jinja2's integer and float literals (underscores allowed).
func (lx *lexer) number() error {
	rest := lx.src[lx.pos:]
	digits := func(s string) int { // (\d+_)*\d+
		n := 0
		for n < len(s) {
			if s[n] >= '0' && s[n] <= '9' {
				n++
			} else if s[n] == '_' && n > 0 && n+1 < len(s) && s[n+1] >= '0' && s[n+1] <= '9' {
				n++
			} else {
				break
			}
		}
		return n
	}
	n := digits(rest)
	isFloat := false
	if n < len(rest) && rest[n] == '.' {
		if m := digits(rest[n+1:]); m > 0 {
			n += 1 + m
			isFloat = true
		}
	}
	if n < len(rest) && (rest[n] == 'e' || rest[n] == 'E') {
		k := n + 1
		if k < len(rest) && (rest[k] == '+' || rest[k] == '-') {
			k++
		}
		if m := digits(rest[k:]); m > 0 {
			n = k + m
			isFloat = true
		}
	}
	lit := strings.ReplaceAll(rest[:n], "_", "")
	tok := token{line: lx.line, val: rest[:n]}
	if isFloat {
		f, err := strconv.ParseFloat(lit, 64)
		if err != nil {
			return lx.errf(lx.line, "bad float literal %q", rest[:n])
		}
		tok.kind, tok.num = tFloat, f
	} else {
		i, err := strconv.ParseInt(lit, 10, 64)
		if err != nil {
			return lx.errf(lx.line, "integer literal %q does not fit in 64 bits", rest[:n])
		}
		tok.kind, tok.num = tInt, i
	}
	lx.toks = append(lx.toks, tok)
	lx.pos += n
	return nil
}

// str lexes a quoted literal and decodes it like Python's "unicode-escape"
// codec, which is what jinja2 applies to string literals.
func (lx *lexer) str(q byte) error {
	src := lx.src
	i := lx.pos + 1
	for i < len(src) && src[i] != q {
		if src[i] == '\\' {
			i++
		}
		i++
	}
	if i >= len(src) {
		return lx.errf(lx.line, "unterminated string literal")
	}
	raw := src[lx.pos+1 : i]
	val, err := unescapePy(raw)
	if err != nil {
		return lx.errf(lx.line, "bad string literal: %v", err)
	}
	lx.toks = append(lx.toks, token{kind: tString, val: val, line: lx.line})
	lx.line += strings.Count(raw, "\n")
	lx.pos = i + 1
	return nil
}

func unescapePy(s string) (string, error) {
	if strings.IndexByte(s, '\\') < 0 {
		return s, nil
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' || i+1 >= len(s) {
			b.WriteByte(c)
			continue
		}
		i++
		switch c = s[i]; c {
		case '\n':
		case '\\', '\'', '"':
			b.WriteByte(c)
		case 'a':
			b.WriteByte(7)
		case 'b':
			b.WriteByte(8)
		case 'f':
			b.WriteByte(12)
		case 'n':
			b.WriteByte('\n')
		case 'r':
			b.WriteByte('\r')
		case 't':
			b.WriteByte('\t')
		case 'v':
			b.WriteByte(11)
		case 'x', 'u', 'U':
			n := map[byte]int{'x': 2, 'u': 4, 'U': 8}[c]
			if i+1+n > len(s) {
				return "", fmt.Errorf("truncated \\%c escape", c)
			}
			v, err := strconv.ParseUint(s[i+1:i+1+n], 16, 32)
			if err != nil {
				return "", fmt.Errorf("bad \\%c escape %q", c, s[i-1:i+1+n])
			}
			if v > unicode.MaxRune || (v >= 0xd800 && v < 0xe000) {
				return "", fmt.Errorf("escape %q is not a valid Unicode scalar value", s[i-1:i+1+n])
			}
			b.WriteRune(rune(v))
			i += n
		case '0', '1', '2', '3', '4', '5', '6', '7':
			v, k := 0, 0
			for k < 3 && i+k < len(s) && s[i+k] >= '0' && s[i+k] <= '7' {
				v = v*8 + int(s[i+k]-'0')
				k++
			}
			b.WriteRune(rune(v))
			i += k - 1
		case 'N':
			return "", fmt.Errorf("\\N{...} escapes are not supported")
		default:
			b.WriteByte('\\')
			b.WriteByte(c)
		}
	}
	return b.String(), nil
}
