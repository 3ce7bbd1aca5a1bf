package chattmpl

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// percentFormat implements Python's "fmt % args" for the conversions chat
// templates plausibly use: s r d i f F e E g G x X o c and %%, with flags,
// width and precision. args is a Tuple (positional), a *Dict (%(name)s), or
// a single value.
func percentFormat(f string, args any) (string, error) {
	var pos []any
	named, _ := args.(*Dict)
	if t, ok := args.(Tuple); ok {
		pos = t
	} else if named == nil {
		pos = []any{args}
	}
	next := 0
	var b strings.Builder
	for i := 0; i < len(f); i++ {
		c := f[i]
		if c != '%' {
			b.WriteByte(c)
			continue
		}
		i++
		if i >= len(f) {
			return "", fmt.Errorf("incomplete format")
		}
		var arg any
		haveArg := false
		if f[i] == '(' {
			j := strings.IndexByte(f[i:], ')')
			if j < 0 || named == nil {
				return "", fmt.Errorf("format requires a mapping")
			}
			v, ok := named.Get(f[i+1 : i+j])
			if !ok {
				return "", fmt.Errorf("KeyError: %s", repr(f[i+1:i+j]))
			}
			arg, haveArg = v, true
			i += j + 1
		}
		start := i
		for i < len(f) && strings.IndexByte("-+ #0", f[i]) >= 0 {
			i++
		}
		flags := f[start:i]
		start = i
		for i < len(f) && f[i] >= '0' && f[i] <= '9' {
			i++
		}
		width := f[start:i]
		prec := ""
		if i < len(f) && f[i] == '.' {
			start = i
			i++
			for i < len(f) && f[i] >= '0' && f[i] <= '9' {
				i++
			}
			prec = f[start:i]
			if prec == "." {
				prec = ".0"
			}
		}
		if i >= len(f) {
			return "", fmt.Errorf("incomplete format")
		}
		verb := f[i]
		if verb == '%' {
			b.WriteByte('%')
			continue
		}
		if !haveArg {
			if named != nil {
				arg = named
			} else {
				if next >= len(pos) {
					return "", fmt.Errorf("not enough arguments for format string")
				}
				arg = pos[next]
				next++
			}
		}
		s, err := formatOne(verb, flags, width, prec, arg)
		if err != nil {
			return "", err
		}
		b.WriteString(s)
	}
	if named == nil && next < len(pos) {
		return "", fmt.Errorf("not all arguments converted during string formatting")
	}
	return b.String(), nil
}

func formatOne(verb byte, flags, width, prec string, arg any) (string, error) {
	var s string
	switch verb {
	case 's', 'r', 'a':
		if verb == 's' {
			s = toStr(arg)
		} else {
			s = repr(arg)
		}
		if prec != "" {
			n, _ := strconv.Atoi(prec[1:])
			if rs := []rune(s); len(rs) > n {
				s = string(rs[:n])
			}
		}
		return pad(s, flags, width), nil
	case 'c':
		if i, ok := asInt(arg); ok {
			return pad(string(rune(i)), flags, width), nil
		}
		if str, ok := arg.(string); ok && utf8.RuneCountInString(str) == 1 {
			return pad(str, flags, width), nil
		}
		return "", fmt.Errorf("%%c requires int or char")
	case 'd', 'i', 'x', 'X', 'o':
		if !isNumber(arg) {
			return "", fmt.Errorf("%%%c format: a real number is required, not %s", verb, typeName(arg))
		}
		i, ok := asInt(arg)
		if !ok {
			i = int64(asFloat(arg))
		}
		v := map[byte]string{'d': "d", 'i': "d", 'x': "x", 'X': "X", 'o': "o"}[verb]
		return fmt.Sprintf("%"+flags+width+prec+v, i), nil
	case 'f', 'F', 'e', 'E', 'g', 'G':
		if !isNumber(arg) {
			return "", fmt.Errorf("must be real number, not %s", typeName(arg))
		}
		if prec == "" {
			prec = ".6"
		}
		x := asFloat(arg)
		if math.IsInf(x, 0) || math.IsNaN(x) {
			return pad(strings.ToLower(formatFloat(x)), flags, width), nil
		}
		return fmt.Sprintf("%"+flags+width+prec+string(verb), x), nil
	}
	return "", fmt.Errorf("unsupported format character '%c'", verb)
}

func pad(s, flags, width string) string {
	w, _ := strconv.Atoi(width)
	n := utf8.RuneCountInString(s)
	if n >= w {
		return s
	}
	if strings.Contains(flags, "-") {
		return s + strings.Repeat(" ", w-n)
	}
	return strings.Repeat(" ", w-n) + s
}

// braceFormat implements str.format for {} {0} {name} {name.attr} {0[key]}
// fields with optional !r/!s and a format spec of the form
// [[fill]align][sign][0][width][.precision][type].
func braceFormat(f string, args []any, kwargs []kwval) (string, error) {
	var b strings.Builder
	auto := 0
	for i := 0; i < len(f); i++ {
		c := f[i]
		if c == '}' {
			if i+1 < len(f) && f[i+1] == '}' {
				b.WriteByte('}')
				i++
				continue
			}
			return "", fmt.Errorf("single '}' encountered in format string")
		}
		if c != '{' {
			b.WriteByte(c)
			continue
		}
		if i+1 < len(f) && f[i+1] == '{' {
			b.WriteByte('{')
			i++
			continue
		}
		j := strings.IndexByte(f[i:], '}')
		if j < 0 {
			return "", fmt.Errorf("single '{' encountered in format string")
		}
		field := f[i+1 : i+j]
		i += j
		spec := ""
		if k := strings.IndexByte(field, ':'); k >= 0 {
			field, spec = field[:k], field[k+1:]
		}
		conv := byte(0)
		if k := strings.IndexByte(field, '!'); k >= 0 {
			if k+2 != len(field) {
				return "", fmt.Errorf("bad conversion in format field")
			}
			conv = field[k+1]
			field = field[:k]
		}
		// split off .attr and [key] accessors
		name := field
		rest := ""
		if k := strings.IndexAny(field, ".["); k >= 0 {
			name, rest = field[:k], field[k:]
		}
		var v any
		switch {
		case name == "":
			if auto >= len(args) {
				return "", fmt.Errorf("replacement index %d out of range", auto)
			}
			v = args[auto]
			auto++
		case name[0] >= '0' && name[0] <= '9':
			n, err := strconv.Atoi(name)
			if err != nil || n >= len(args) {
				return "", fmt.Errorf("replacement index %s out of range", name)
			}
			v = args[n]
		default:
			found := false
			for _, kv := range kwargs {
				if kv.name == name {
					v, found = kv.v, true
				}
			}
			if !found {
				return "", fmt.Errorf("KeyError: %s", repr(name))
			}
		}
		for rest != "" {
			var err error
			if rest[0] == '.' {
				k := strings.IndexAny(rest[1:], ".[")
				attr := rest[1:]
				if k >= 0 {
					attr, rest = rest[1:k+1], rest[k+1:]
				} else {
					rest = ""
				}
				v, err = getAttr(v, attr)
			} else {
				k := strings.IndexByte(rest, ']')
				if k < 0 {
					return "", fmt.Errorf("missing ']' in format string")
				}
				var key any = rest[1:k]
				if n, e := strconv.ParseInt(rest[1:k], 10, 64); e == nil {
					key = n
				}
				rest = rest[k+1:]
				v, err = getItem(v, key)
			}
			if err != nil {
				return "", err
			}
		}
		switch conv {
		case 'r', 'a':
			v = repr(v)
		case 's':
			v = toStr(v)
		case 0:
		default:
			return "", fmt.Errorf("unknown conversion specifier %c", conv)
		}
		s, err := formatSpec(v, spec)
		if err != nil {
			return "", err
		}
		b.WriteString(s)
	}
	return b.String(), nil
}

func formatSpec(v any, spec string) (string, error) {
	if spec == "" {
		return toStr(v), nil
	}
	fill, align := " ", byte(0)
	rs := []rune(spec)
	if len(rs) >= 2 && strings.ContainsRune("<>^=", rs[1]) {
		fill, align = string(rs[0]), byte(rs[1])
		spec = string(rs[2:])
	} else if len(spec) >= 1 && strings.IndexByte("<>^=", spec[0]) >= 0 {
		align = spec[0]
		spec = spec[1:]
	}
	sign := ""
	if len(spec) > 0 && strings.IndexByte("+- ", spec[0]) >= 0 {
		sign, spec = spec[:1], spec[1:]
	}
	if len(spec) > 0 && spec[0] == '0' {
		fill, spec = "0", spec[1:]
		if align == 0 {
			align = '='
		}
	}
	k := 0
	for k < len(spec) && spec[k] >= '0' && spec[k] <= '9' {
		k++
	}
	width, _ := strconv.Atoi(spec[:k])
	spec = spec[k:]
	prec := -1
	if len(spec) > 0 && spec[0] == '.' {
		k = 1
		for k < len(spec) && spec[k] >= '0' && spec[k] <= '9' {
			k++
		}
		prec, _ = strconv.Atoi(spec[1:k])
		spec = spec[k:]
	}
	group := ""
	if len(spec) > 0 && (spec[0] == ',' || spec[0] == '_') {
		group, spec = spec[:1], spec[1:]
	}
	typ := byte(0)
	if len(spec) == 1 {
		typ = spec[0]
	} else if spec != "" {
		return "", fmt.Errorf("unsupported format spec %q", spec)
	}
	var s string
	numeric := false
	switch typ {
	case 0, 's':
		if isNumber(v) && typ == 0 {
			numeric = true
			if _, isBool := v.(bool); !isBool && prec >= 0 {
				if f, ok := v.(float64); ok {
					s = strconv.FormatFloat(f, 'g', prec, 64)
					break
				}
			}
		}
		s = toStr(v)
		if !numeric && prec >= 0 {
			if r := []rune(s); len(r) > prec {
				s = string(r[:prec])
			}
		}
	case 'd', 'x', 'X', 'o', 'b':
		i, ok := asInt(v)
		if !ok {
			return "", fmt.Errorf("unknown format code '%c' for object of type '%s'", typ, typeName(v))
		}
		numeric = true
		base := map[byte]int{'d': 10, 'x': 16, 'X': 16, 'o': 8, 'b': 2}[typ]
		s = strconv.FormatInt(i, base)
		if typ == 'X' {
			s = strings.ToUpper(s)
		}
	case 'f', 'F', 'e', 'E', 'g', 'G', '%':
		if !isNumber(v) {
			return "", fmt.Errorf("unknown format code '%c' for object of type '%s'", typ, typeName(v))
		}
		numeric = true
		if prec < 0 {
			prec = 6
		}
		x := asFloat(v)
		if typ == '%' {
			s = strconv.FormatFloat(x*100, 'f', prec, 64) + "%"
		} else {
			s = fmt.Sprintf("%."+strconv.Itoa(prec)+string(typ), x)
		}
	default:
		return "", fmt.Errorf("unsupported format type '%c'", typ)
	}
	if group != "" && numeric {
		s = groupDigits(s, group)
	}
	if numeric && sign != "" && sign != "-" && !strings.HasPrefix(s, "-") {
		if sign == "+" {
			s = "+" + s
		} else {
			s = " " + s
		}
	}
	if align == 0 {
		align = '<'
		if numeric {
			align = '>'
		}
	}
	n := utf8.RuneCountInString(s)
	if n >= width {
		return s, nil
	}
	padN := width - n
	switch align {
	case '<':
		return s + strings.Repeat(fill, padN), nil
	case '>':
		return strings.Repeat(fill, padN) + s, nil
	case '^':
		return strings.Repeat(fill, padN/2) + s + strings.Repeat(fill, padN-padN/2), nil
	}
	// '=': pad after the sign
	if strings.HasPrefix(s, "-") || strings.HasPrefix(s, "+") || strings.HasPrefix(s, " ") {
		return s[:1] + strings.Repeat(fill, padN) + s[1:], nil
	}
	return strings.Repeat(fill, padN) + s, nil
}

// strftime implements the C89 directives of Python's datetime.strftime in the
// C locale, which is what strftime_now (Llama 3.x templates) calls.
func strftime(f string, t time.Time) (string, error) {
	var b strings.Builder
	for i := 0; i < len(f); i++ {
		if f[i] != '%' || i+1 >= len(f) {
			b.WriteByte(f[i])
			continue
		}
		i++
		switch f[i] {
		case 'a':
			b.WriteString(t.Format("Mon"))
		case 'A':
			b.WriteString(t.Format("Monday"))
		case 'b', 'h':
			b.WriteString(t.Format("Jan"))
		case 'B':
			b.WriteString(t.Format("January"))
		case 'd':
			fmt.Fprintf(&b, "%02d", t.Day())
		case 'e':
			fmt.Fprintf(&b, "%2d", t.Day())
		case 'm':
			fmt.Fprintf(&b, "%02d", int(t.Month()))
		case 'y':
			fmt.Fprintf(&b, "%02d", t.Year()%100)
		case 'Y':
			fmt.Fprintf(&b, "%d", t.Year())
		case 'H':
			fmt.Fprintf(&b, "%02d", t.Hour())
		case 'I':
			h := t.Hour() % 12
			if h == 0 {
				h = 12
			}
			fmt.Fprintf(&b, "%02d", h)
		case 'p':
			if t.Hour() < 12 {
				b.WriteString("AM")
			} else {
				b.WriteString("PM")
			}
		case 'M':
			fmt.Fprintf(&b, "%02d", t.Minute())
		case 'S':
			fmt.Fprintf(&b, "%02d", t.Second())
		case 'f':
			fmt.Fprintf(&b, "%06d", t.Nanosecond()/1000)
		case 'j':
			fmt.Fprintf(&b, "%03d", t.YearDay())
		case 'w':
			fmt.Fprintf(&b, "%d", int(t.Weekday()))
		case 'u':
			wd := int(t.Weekday())
			if wd == 0 {
				wd = 7
			}
			fmt.Fprintf(&b, "%d", wd)
		case '%':
			b.WriteByte('%')
		default:
			return "", fmt.Errorf("strftime directive %%%c is not supported by chattmpl", f[i])
		}
	}
	return b.String(), nil
}

// groupDigits inserts a thousands separator into the integer part of a
// formatted number ("{:,}").
func groupDigits(s, sep string) string {
	neg := strings.HasPrefix(s, "-")
	if neg {
		s = s[1:]
	}
	end := strings.IndexAny(s, ".eE%")
	if end < 0 {
		end = len(s)
	}
	intPart, rest := s[:end], s[end:]
	var b strings.Builder
	for i, c := range intPart {
		if i > 0 && (len(intPart)-i)%3 == 0 {
			b.WriteString(sep)
		}
		b.WriteRune(c)
	}
	out := b.String() + rest
	if neg {
		out = "-" + out
	}
	return out
}
