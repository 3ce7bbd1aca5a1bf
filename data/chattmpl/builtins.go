package chattmpl

import (
	"fmt"
	"math"
	"math/big"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

type (
	filterFunc func(r *renderer, v any, args []any, kwargs []kwval) (any, error)
	testFunc   func(r *renderer, v any, args []any, kwargs []kwval) (bool, error)
)

// params binds positional and keyword arguments to named parameters the way
// Python does, so filters can be called either way (join(", ") or
// join(d=", ")).
func params(fname string, args []any, kwargs []kwval, names []string, defaults []any) ([]any, error) {
	if len(args) > len(names) {
		return nil, fmt.Errorf("%s takes at most %d arguments (%d given)", fname, len(names), len(args))
	}
	out := make([]any, len(names))
	set := make([]bool, len(names))
	for i, a := range args {
		out[i], set[i] = a, true
	}
	for _, k := range kwargs {
		found := false
		for i, n := range names {
			if n == k.name {
				if set[i] {
					return nil, fmt.Errorf("%s got multiple values for argument '%s'", fname, n)
				}
				out[i], set[i], found = k.v, true, true
			}
		}
		if !found {
			return nil, fmt.Errorf("%s got an unexpected keyword argument '%s'", fname, k.name)
		}
	}
	for i := range names {
		if !set[i] {
			if i >= len(defaults) || defaults[i] == required {
				return nil, fmt.Errorf("%s missing required argument '%s'", fname, names[i])
			}
			out[i] = defaults[i]
		}
	}
	return out, nil
}

// required marks a parameter without default in params().
var required = &struct{ x int }{}

func wantStr(fname string, v any) (string, error) {
	s, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("%s expects a string, got %s", fname, typeName(v))
	}
	return s, nil
}

func optStr(fname string, v any) (*string, error) {
	if v == nil {
		return nil, nil
	}
	s, err := wantStr(fname, v)
	return &s, err
}

func wantInt(fname string, v any) (int64, error) {
	i, ok := asInt(v)
	if !ok {
		return 0, fmt.Errorf("%s expects an integer, got %s", fname, typeName(v))
	}
	return i, nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// ---- filters (jinja2/filters.py semantics; tojson is transformers' override) ----

var filters map[string]filterFunc

func init() {
	filters = map[string]filterFunc{
		"abs": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			switch x := v.(type) {
			case bool, int64:
				i, _ := asInt(x)
				if i < 0 {
					return -i, nil
				}
				return i, nil
			case float64:
				return math.Abs(x), nil
			}
			return nil, fmt.Errorf("bad operand type for abs(): '%s'", typeName(v))
		},
		"attr": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("attr", a, k, []string{"name"}, []any{required})
			if err != nil {
				return nil, err
			}
			name, err := wantStr("attr", p[0])
			if err != nil {
				return nil, err
			}
			// jinja2's do_attr is a plain getattr: unlike obj.name it never
			// falls back to obj["name"], so a dict key is not found.
			if d, ok := v.(*Dict); ok {
				if m, ok := method(d, name); ok {
					return m, nil
				}
				return Undefined{hint: fmt.Sprintf("'dict object' has no attribute '%s'", name)}, nil
			}
			return getAttr(v, name)
		},
		"capitalize": strFilter(func(s string) string {
			rs := []rune(strings.ToLower(s))
			if len(rs) > 0 {
				rs[0] = unicode.ToTitle(rs[0])
			}
			return string(rs)
		}),
		"center": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("center", a, k, []string{"width"}, []any{int64(80)})
			if err != nil {
				return nil, err
			}
			w, err := wantInt("center", p[0])
			if err != nil {
				return nil, err
			}
			return pyCenter(toStr(v), int(w), " "), nil
		},
		"default":     filterDefault,
		"d":           filterDefault,
		"dictsort":    filterDictsort,
		"escape":      strFilter(htmlEscape),
		"e":           strFilter(htmlEscape),
		"forceescape": strFilter(htmlEscape),
		"first": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			xs, err := iterate(v)
			if err != nil {
				return nil, err
			}
			if len(xs) == 0 {
				return Undefined{hint: "no first item, sequence was empty"}, nil
			}
			return xs[0], nil
		},
		"last": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			xs, err := iterate(v)
			if err != nil {
				return nil, err
			}
			if len(xs) == 0 {
				return Undefined{hint: "no last item, sequence was empty"}, nil
			}
			return xs[len(xs)-1], nil
		},
		"float": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("float", a, k, []string{"default"}, []any{0.0})
			if err != nil {
				return nil, err
			}
			switch x := v.(type) {
			case bool, int64, float64:
				return asFloat(x), nil
			case string:
				if f, err := strconv.ParseFloat(strings.TrimSpace(strings.ReplaceAll(x, "_", "")), 64); err == nil {
					return f, nil
				}
			}
			return p[0], nil
		},
		"format": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			s, err := wantStr("format", v)
			if err != nil {
				return nil, err
			}
			if len(k) > 0 {
				d := NewDict()
				for _, kv := range k {
					d.Set(kv.name, kv.v)
				}
				return percentFormat(s, d)
			}
			return percentFormat(s, Tuple(a))
		},
		"indent": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("indent", a, k, []string{"width", "first", "blank"}, []any{int64(4), false, false})
			if err != nil {
				return nil, err
			}
			ind := ""
			if s, ok := p[0].(string); ok {
				ind = s
			} else {
				w, err := wantInt("indent", p[0])
				if err != nil {
					return nil, err
				}
				ind = strings.Repeat(" ", int(w))
			}
			s := toStr(v) + "\n" // jinja2 appends a newline, indents, then drops it
			lines := strings.SplitAfter(s, "\n")
			lines = lines[:len(lines)-1]
			var b strings.Builder
			for i, l := range lines {
				body := strings.TrimSuffix(l, "\n")
				if i == 0 {
					if truthy(p[1]) {
						b.WriteString(ind)
					}
					b.WriteString(l)
					continue
				}
				if truthy(p[2]) || body != "" {
					b.WriteString(ind)
				}
				b.WriteString(l)
			}
			return strings.TrimSuffix(b.String(), "\n"), nil
		},
		"int": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("int", a, k, []string{"default", "base"}, []any{int64(0), int64(10)})
			if err != nil {
				return nil, err
			}
			switch x := v.(type) {
			case bool, int64:
				i, _ := asInt(x)
				return i, nil
			case float64:
				if math.IsNaN(x) || math.IsInf(x, 0) {
					return p[0], nil
				}
				return int64(x), nil
			case string:
				base, _ := asInt(p[1])
				t := strings.TrimSpace(strings.ReplaceAll(x, "_", ""))
				if i, err := strconv.ParseInt(t, int(base), 64); err == nil {
					return i, nil
				}
				if f, err := strconv.ParseFloat(t, 64); err == nil {
					return int64(f), nil
				}
			}
			return p[0], nil
		},
		"items": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			switch x := v.(type) {
			case Undefined:
				return []any{}, nil
			case *Dict:
				return dictItems(x), nil
			}
			return nil, fmt.Errorf("can only get item pairs from a mapping, not %s", typeName(v))
		},
		"join": func(r *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("join", a, k, []string{"d", "attribute"}, []any{"", nil})
			if err != nil {
				return nil, err
			}
			xs, err := iterate(v)
			if err != nil {
				return nil, err
			}
			parts := make([]string, len(xs))
			for i, x := range xs {
				if p[1] != nil {
					if x, err = attrPath(x, p[1]); err != nil {
						return nil, err
					}
				}
				parts[i] = toStr(x)
			}
			return strings.Join(parts, toStr(p[0])), nil
		},
		"length": filterLength,
		"count":  filterLength,
		"list": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			xs, err := iterate(v)
			if err != nil {
				return nil, err
			}
			return append([]any{}, xs...), nil
		},
		"lower": strFilter(strings.ToLower),
		"upper": strFilter(strings.ToUpper),
		"map":   filterMap,
		"max":   func(r *renderer, v any, a []any, k []kwval) (any, error) { return minMax(r, v, a, k, "max") },
		"min":   func(r *renderer, v any, a []any, k []kwval) (any, error) { return minMax(r, v, a, k, "min") },
		"reject": func(r *renderer, v any, a []any, k []kwval) (any, error) {
			return selectOrReject(r, v, a, k, false, false)
		},
		"rejectattr": func(r *renderer, v any, a []any, k []kwval) (any, error) {
			return selectOrReject(r, v, a, k, false, true)
		},
		"select": func(r *renderer, v any, a []any, k []kwval) (any, error) {
			return selectOrReject(r, v, a, k, true, false)
		},
		"selectattr": func(r *renderer, v any, a []any, k []kwval) (any, error) {
			return selectOrReject(r, v, a, k, true, true)
		},
		"replace": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("replace", a, k, []string{"old", "new", "count"}, []any{required, required, nil})
			if err != nil {
				return nil, err
			}
			n := int64(-1)
			if p[2] != nil {
				if n, err = wantInt("replace", p[2]); err != nil {
					return nil, err
				}
			}
			return pyReplace(toStr(v), toStr(p[0]), toStr(p[1]), n), nil
		},
		"reverse": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			if s, ok := v.(string); ok {
				return sliceValue(s, nil, nil, int64(-1))
			}
			xs, err := iterate(v)
			if err != nil {
				return nil, err
			}
			out := make([]any, len(xs))
			for i, x := range xs {
				out[len(xs)-1-i] = x
			}
			return out, nil
		},
		"round": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("round", a, k, []string{"precision", "method"}, []any{int64(0), "common"})
			if err != nil {
				return nil, err
			}
			prec, err := wantInt("round", p[0])
			if err != nil {
				return nil, err
			}
			if !isNumber(v) {
				return nil, fmt.Errorf("round expects a number, got %s", typeName(v))
			}
			f, m := asFloat(v), math.Pow(10, float64(prec))
			switch p[1] {
			case "common":
				return pyRound(f, int(prec)), nil
			case "ceil":
				return math.Ceil(f*m) / m, nil
			case "floor":
				return math.Floor(f*m) / m, nil
			}
			return nil, fmt.Errorf("method must be common, ceil or floor")
		},
		"safe": func(_ *renderer, v any, a []any, k []kwval) (any, error) { return v, nil },
		"sort": func(r *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("sort", a, k, []string{"reverse", "case_sensitive", "attribute"}, []any{false, false, nil})
			if err != nil {
				return nil, err
			}
			xs, err := iterate(v)
			if err != nil {
				return nil, err
			}
			out := append([]any{}, xs...)
			return out, sortValues(out, sortKey(p[2], truthy(p[1])), truthy(p[0]))
		},
		"string": func(_ *renderer, v any, a []any, k []kwval) (any, error) { return toStr(v), nil },
		"sum": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("sum", a, k, []string{"attribute", "start"}, []any{nil, int64(0)})
			if err != nil {
				return nil, err
			}
			xs, err := iterate(v)
			if err != nil {
				return nil, err
			}
			acc := p[1]
			for _, x := range xs {
				if p[0] != nil {
					if x, err = attrPath(x, p[0]); err != nil {
						return nil, err
					}
				}
				if acc, err = binaryOp("+", acc, x); err != nil {
					return nil, err
				}
			}
			return acc, nil
		},
		"title":  strFilter(jinjaTitle),
		"tojson": filterToJSON,
		"trim": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("trim", a, k, []string{"chars"}, []any{nil})
			if err != nil {
				return nil, err
			}
			chars, err := optStr("trim", p[0])
			if err != nil {
				return nil, err
			}
			return pyStrip(toStr(v), chars, true, true), nil
		},
		"unique": func(r *renderer, v any, a []any, k []kwval) (any, error) {
			p, err := params("unique", a, k, []string{"case_sensitive", "attribute"}, []any{false, nil})
			if err != nil {
				return nil, err
			}
			xs, err := iterate(v)
			if err != nil {
				return nil, err
			}
			key := sortKey(p[1], truthy(p[0]))
			var out, seen []any
			for _, x := range xs {
				kx, err := key(x)
				if err != nil {
					return nil, err
				}
				dup := false
				for _, s := range seen {
					if pyEqual(s, kx) {
						dup = true
						break
					}
				}
				if !dup {
					seen = append(seen, kx)
					out = append(out, x)
				}
			}
			if out == nil {
				out = []any{}
			}
			return out, nil
		},
		"wordcount": func(_ *renderer, v any, a []any, k []kwval) (any, error) {
			return int64(len(wordRe.FindAllString(toStr(v), -1))), nil
		},
	}
}

var wordRe = regexp.MustCompile(`[\p{L}\p{N}_]+`)

func strFilter(f func(string) string) filterFunc {
	return func(_ *renderer, v any, a []any, k []kwval) (any, error) {
		if len(a)+len(k) > 0 {
			return nil, fmt.Errorf("takes no arguments")
		}
		return f(toStr(v)), nil
	}
}

// htmlEscape follows markupsafe's entity choice (&#34; &#39;), which differs
// from html.EscapeString's.
func htmlEscape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&#34;", "'", "&#39;").Replace(s)
}

func filterDefault(_ *renderer, v any, a []any, k []kwval) (any, error) {
	p, err := params("default", a, k, []string{"default_value", "boolean"}, []any{"", false})
	if err != nil {
		return nil, err
	}
	if _, undef := v.(Undefined); undef || (truthy(p[1]) && !truthy(v)) {
		return p[0], nil
	}
	return v, nil
}

func filterLength(_ *renderer, v any, a []any, k []kwval) (any, error) {
	n, err := pyLen(v)
	return int64(n), err
}

func dictItems(d *Dict) []any {
	out := make([]any, d.Len())
	for i, k := range d.keys {
		out[i] = Tuple{k, d.vals[i]}
	}
	return out
}

func filterDictsort(_ *renderer, v any, a []any, k []kwval) (any, error) {
	p, err := params("dictsort", a, k, []string{"case_sensitive", "by", "reverse"}, []any{false, "key", false})
	if err != nil {
		return nil, err
	}
	d, ok := v.(*Dict)
	if !ok {
		return nil, fmt.Errorf("dictsort expects a dict, got %s", typeName(v))
	}
	pos := 0
	switch p[1] {
	case "key":
	case "value":
		pos = 1
	default:
		return nil, fmt.Errorf("you can only sort by either 'key' or 'value'")
	}
	items := dictItems(d)
	cs := truthy(p[0])
	return items, sortValues(items, func(x any) (any, error) {
		e := x.(Tuple)[pos]
		if s, ok := e.(string); ok && !cs {
			return strings.ToLower(s), nil
		}
		return e, nil
	}, truthy(p[2]))
}

// attrPath resolves jinja2's attribute="a.b.0" lookups.
func attrPath(x any, attr any) (any, error) {
	if i, ok := asInt(attr); ok {
		return getItem(x, i)
	}
	s, ok := attr.(string)
	if !ok {
		return nil, fmt.Errorf("attribute must be a string, got %s", typeName(attr))
	}
	for _, part := range strings.Split(s, ".") {
		var key any = part
		if n, err := strconv.ParseInt(part, 10, 64); err == nil {
			key = n
		}
		var err error
		if x, err = getItem(x, key); err != nil {
			return nil, err
		}
	}
	return x, nil
}

func sortKey(attr any, caseSensitive bool) func(any) (any, error) {
	return func(x any) (any, error) {
		if attr != nil {
			var err error
			if x, err = attrPath(x, attr); err != nil {
				return nil, err
			}
		}
		if s, ok := x.(string); ok && !caseSensitive {
			return strings.ToLower(s), nil
		}
		return x, nil
	}
}

func minMax(r *renderer, v any, a []any, k []kwval, which string) (any, error) {
	p, err := params(which, a, k, []string{"case_sensitive", "attribute"}, []any{false, nil})
	if err != nil {
		return nil, err
	}
	xs, err := iterate(v)
	if err != nil {
		return nil, err
	}
	if len(xs) == 0 {
		return Undefined{hint: "no " + which + " item, sequence was empty"}, nil
	}
	key := sortKey(p[1], truthy(p[0]))
	best := xs[0]
	bk, err := key(best)
	if err != nil {
		return nil, err
	}
	for _, x := range xs[1:] {
		kx, err := key(x)
		if err != nil {
			return nil, err
		}
		c, err := pyCompare(kx, bk, "<")
		if err != nil {
			return nil, err
		}
		if (which == "min" && c < 0) || (which == "max" && c > 0) {
			best, bk = x, kx
		}
	}
	return best, nil
}

func filterMap(r *renderer, v any, a []any, k []kwval) (any, error) {
	xs, err := iterate(v)
	if err != nil {
		return nil, err
	}
	out := make([]any, 0, len(xs))
	if len(a) == 0 {
		var attr any
		def := any(nil)
		hasDef := false
		for _, kv := range k {
			switch kv.name {
			case "attribute":
				attr = kv.v
			case "default":
				def, hasDef = kv.v, true
			default:
				return nil, fmt.Errorf("map got an unexpected keyword argument '%s'", kv.name)
			}
		}
		if attr == nil {
			return nil, fmt.Errorf("map needs a filter name or attribute=")
		}
		for _, x := range xs {
			y, err := attrPath(x, attr)
			if err != nil {
				return nil, err
			}
			if _, undef := y.(Undefined); undef && hasDef {
				y = def
			}
			out = append(out, y)
		}
		return out, nil
	}
	name, err := wantStr("map", a[0])
	if err != nil {
		return nil, err
	}
	f, ok := filters[name]
	if !ok {
		return nil, fmt.Errorf("no filter named '%s'", name)
	}
	for _, x := range xs {
		y, err := f(r, x, a[1:], k)
		if err != nil {
			return nil, err
		}
		out = append(out, y)
	}
	return out, nil
}

func selectOrReject(r *renderer, v any, a []any, k []kwval, want, byAttr bool) (any, error) {
	xs, err := iterate(v)
	if err != nil {
		return nil, err
	}
	var attr any
	if byAttr {
		if len(a) == 0 {
			return nil, fmt.Errorf("missing attribute name")
		}
		attr, a = a[0], a[1:]
	}
	var test testFunc
	if len(a) > 0 {
		name, err := wantStr("test name", a[0])
		if err != nil {
			return nil, err
		}
		t, ok := tests[name]
		if !ok {
			return nil, fmt.Errorf("no test named '%s'", name)
		}
		test, a = t, a[1:]
	}
	out := []any{}
	for _, x := range xs {
		y := x
		if byAttr {
			if y, err = attrPath(x, attr); err != nil {
				return nil, err
			}
		}
		ok := truthy(y)
		if test != nil {
			if ok, err = test(r, y, a, k); err != nil {
				return nil, err
			}
		}
		if ok == want {
			out = append(out, x)
		}
	}
	return out, nil
}

// pyRound is Python's round(x, n) for floats: exact decimal rounding with
// ties to even, done through shortest repr strings to avoid double rounding.
func pyRound(f float64, n int) float64 {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return f
	}
	s := strconv.FormatFloat(f, 'f', n, 64) // Go rounds the exact binary value half-to-even: same as CPython
	r, _ := strconv.ParseFloat(s, 64)
	return r
}

func pyCenter(s string, width int, fill string) string {
	n := utf8.RuneCountInString(s)
	if width <= n {
		return s
	}
	marg := width - n
	left := marg/2 + (marg & width & 1)
	return strings.Repeat(fill, left) + s + strings.Repeat(fill, marg-left)
}

func pyReplace(s, old, new string, n int64) string {
	if old == "" {
		// Python inserts new between every character (and at both ends).
		rs := []rune(s)
		var b strings.Builder
		count := int64(0)
		for i := 0; i <= len(rs); i++ {
			if n < 0 || count < n {
				b.WriteString(new)
				count++
			}
			if i < len(rs) {
				b.WriteRune(rs[i])
			}
		}
		return b.String()
	}
	return strings.Replace(s, old, new, int(n))
}

var titleSplitRe = regexp.MustCompile(`([-\s({\[<]+)`)

// jinjaTitle is jinja2's do_title: uppercase the first character of each
// word, where words are split on whitespace, '-', and opening brackets.
func jinjaTitle(s string) string {
	var b strings.Builder
	last := 0
	emit := func(item string) {
		if item == "" {
			return
		}
		r, n := utf8.DecodeRuneInString(item)
		b.WriteString(strings.ToUpper(string(r)))
		b.WriteString(strings.ToLower(item[n:]))
	}
	for _, m := range titleSplitRe.FindAllStringIndex(s, -1) {
		emit(s[last:m[0]])
		emit(s[m[0]:m[1]])
		last = m[1]
	}
	emit(s[last:])
	return b.String()
}

// ---- tests ----

var tests map[string]testFunc

func init() {
	typeTest := func(f func(any) bool) testFunc {
		return func(_ *renderer, v any, a []any, k []kwval) (bool, error) { return f(v), nil }
	}
	cmpTest := func(op string) testFunc {
		return func(_ *renderer, v any, a []any, k []kwval) (bool, error) {
			if len(a) != 1 {
				return false, fmt.Errorf("expects one argument")
			}
			return compareOp(op, v, a[0])
		}
	}
	tests = map[string]testFunc{
		"boolean":   typeTest(func(v any) bool { _, ok := v.(bool); return ok }),
		"callable":  typeTest(func(v any) bool { return isCallable(v) }),
		"defined":   typeTest(func(v any) bool { _, u := v.(Undefined); return !u }),
		"undefined": typeTest(func(v any) bool { _, u := v.(Undefined); return u }),
		"divisibleby": func(_ *renderer, v any, a []any, k []kwval) (bool, error) {
			if len(a) != 1 {
				return false, fmt.Errorf("expects one argument")
			}
			m, err := binaryOp("%", v, a[0])
			if err != nil {
				return false, err
			}
			return pyEqual(m, int64(0)), nil
		},
		"eq": cmpTest("=="), "equalto": cmpTest("=="), "==": cmpTest("=="),
		"ne": cmpTest("!="), "!=": cmpTest("!="),
		"lt": cmpTest("<"), "lessthan": cmpTest("<"), "<": cmpTest("<"),
		"le": cmpTest("<="), "<=": cmpTest("<="),
		"gt": cmpTest(">"), "greaterthan": cmpTest(">"), ">": cmpTest(">"),
		"ge": cmpTest(">="), ">=": cmpTest(">="),
		"in": func(_ *renderer, v any, a []any, k []kwval) (bool, error) {
			if len(a) != 1 {
				return false, fmt.Errorf("expects one argument")
			}
			return contains(a[0], v)
		},
		"even": func(_ *renderer, v any, a []any, k []kwval) (bool, error) {
			i, err := wantInt("even", v)
			return i%2 == 0, err
		},
		"odd": func(_ *renderer, v any, a []any, k []kwval) (bool, error) {
			i, err := wantInt("odd", v)
			return i%2 != 0, err
		},
		"false":   typeTest(func(v any) bool { return v == false }),
		"true":    typeTest(func(v any) bool { return v == true }),
		"none":    typeTest(func(v any) bool { return v == nil }),
		"float":   typeTest(func(v any) bool { _, ok := v.(float64); return ok }),
		"integer": typeTest(func(v any) bool { _, ok := v.(int64); _, big := v.(*big.Int); return ok || big }),
		"number":  typeTest(func(v any) bool { _, big := v.(*big.Int); return isNumber(v) || big }),
		"string":  typeTest(func(v any) bool { _, ok := v.(string); return ok }),
		"mapping": typeTest(func(v any) bool { _, ok := v.(*Dict); return ok }),
		"iterable": typeTest(func(v any) bool {
			switch v.(type) {
			case string, []any, Tuple, *Dict, Undefined, rangeVal:
				return true
			}
			return false
		}),
		"sequence": typeTest(func(v any) bool {
			switch v.(type) {
			case string, []any, Tuple, *Dict, rangeVal:
				return true
			}
			return false
		}),
		"lower": typeTest(func(v any) bool { s := toStr(v); return s == strings.ToLower(s) && s != strings.ToUpper(s) }),
		"upper": typeTest(func(v any) bool { s := toStr(v); return s == strings.ToUpper(s) && s != strings.ToLower(s) }),
		"sameas": func(_ *renderer, v any, a []any, k []kwval) (bool, error) {
			if len(a) != 1 {
				return false, fmt.Errorf("expects one argument")
			}
			return sameAs(v, a[0]), nil
		},
		"escaped": typeTest(func(v any) bool { return false }),
		"filter":  typeTest(func(v any) bool { s, ok := v.(string); return ok && filters[s] != nil }),
		"test":    typeTest(func(v any) bool { s, ok := v.(string); return ok && tests[s] != nil }),
	}
}

func isCallable(v any) bool {
	switch v.(type) {
	case builtinFunc, *macro:
		return true
	}
	return false
}

// sameAs approximates Python's "is" for the singletons templates test with.
func sameAs(a, b any) bool {
	switch x := a.(type) {
	case nil, bool:
		return a == b
	case *Dict:
		y, ok := b.(*Dict)
		return ok && x == y
	case *Namespace:
		y, ok := b.(*Namespace)
		return ok && x == y
	case []any:
		y, ok := b.([]any)
		return ok && len(x) == len(y) && (len(x) == 0 || &x[0] == &y[0])
	}
	return false
}

// ---- methods of str, dict and list ----

// method returns the bound method obj.name. Methods that mutate are absent:
// ImmutableSandboxedEnvironment refuses them too.
func method(obj any, name string) (any, bool) {
	var f func(args []any, k []kwval) (any, error)
	switch o := obj.(type) {
	case string:
		f = strMethod(o, name)
	case *Dict:
		f = dictMethod(o, name)
	case []any:
		f = seqMethod(o, name)
	case Tuple:
		f = seqMethod(o, name)
	}
	if f == nil {
		return nil, false
	}
	return builtinFunc(func(_ *renderer, args []any, k []kwval) (any, error) {
		v, err := f(args, k)
		if err != nil {
			return nil, fmt.Errorf("%s.%s(): %w", typeName(obj), name, err)
		}
		return v, nil
	}), true
}

func dictMethod(d *Dict, name string) func([]any, []kwval) (any, error) {
	switch name {
	case "items":
		return func(a []any, k []kwval) (any, error) { return dictItems(d), nil }
	case "keys":
		return func(a []any, k []kwval) (any, error) { return append([]any{}, d.keys...), nil }
	case "values":
		return func(a []any, k []kwval) (any, error) { return append([]any{}, d.vals...), nil }
	case "get":
		return func(a []any, k []kwval) (any, error) {
			p, err := params("get", a, k, []string{"key", "default"}, []any{required, nil})
			if err != nil {
				return nil, err
			}
			if v, ok := d.Get(p[0]); ok {
				return v, nil
			}
			return p[1], nil
		}
	case "copy":
		return func(a []any, k []kwval) (any, error) {
			c := NewDict()
			for i, key := range d.keys {
				c.Set(key, d.vals[i])
			}
			return c, nil
		}
	}
	return nil
}

func seqMethod(xs []any, name string) func([]any, []kwval) (any, error) {
	switch name {
	case "index":
		return func(a []any, k []kwval) (any, error) {
			if len(a) != 1 {
				return nil, fmt.Errorf("takes exactly one argument")
			}
			for i, x := range xs {
				if pyEqual(x, a[0]) {
					return int64(i), nil
				}
			}
			return nil, fmt.Errorf("%s is not in list", repr(a[0]))
		}
	case "count":
		return func(a []any, k []kwval) (any, error) {
			if len(a) != 1 {
				return nil, fmt.Errorf("takes exactly one argument")
			}
			n := int64(0)
			for _, x := range xs {
				if pyEqual(x, a[0]) {
					n++
				}
			}
			return n, nil
		}
	}
	return nil
}

func strMethod(s string, name string) func([]any, []kwval) (any, error) {
	strip := func(left, right bool) func([]any, []kwval) (any, error) {
		return func(a []any, k []kwval) (any, error) {
			p, err := params(name, a, k, []string{"chars"}, []any{nil})
			if err != nil {
				return nil, err
			}
			chars, err := optStr(name, p[0])
			if err != nil {
				return nil, err
			}
			return pyStrip(s, chars, left, right), nil
		}
	}
	noArgs := func(f func() any) func([]any, []kwval) (any, error) {
		return func(a []any, k []kwval) (any, error) {
			if len(a)+len(k) > 0 {
				return nil, fmt.Errorf("takes no arguments")
			}
			return f(), nil
		}
	}
	allRunes := func(pred func(rune) bool) func([]any, []kwval) (any, error) {
		return noArgs(func() any {
			if s == "" {
				return false
			}
			for _, r := range s {
				if !pred(r) {
					return false
				}
			}
			return true
		})
	}
	switch name {
	case "strip":
		return strip(true, true)
	case "lstrip":
		return strip(true, false)
	case "rstrip":
		return strip(false, true)
	case "upper":
		return noArgs(func() any { return strings.ToUpper(s) })
	case "lower":
		return noArgs(func() any { return strings.ToLower(s) })
	case "title":
		return noArgs(func() any { return pyTitle(s) })
	case "capitalize":
		return noArgs(func() any {
			rs := []rune(strings.ToLower(s))
			if len(rs) > 0 {
				rs[0] = unicode.ToTitle(rs[0])
			}
			return string(rs)
		})
	case "swapcase":
		return noArgs(func() any {
			return strings.Map(func(r rune) rune {
				if unicode.IsUpper(r) {
					return unicode.ToLower(r)
				}
				return unicode.ToUpper(r)
			}, s)
		})
	case "isdigit", "isnumeric", "isdecimal":
		return allRunes(unicode.IsDigit)
	case "isalpha":
		return allRunes(unicode.IsLetter)
	case "isalnum":
		return allRunes(func(r rune) bool { return unicode.IsLetter(r) || unicode.IsDigit(r) })
	case "isspace":
		return allRunes(isSpace)
	case "islower":
		return noArgs(func() any { return s == strings.ToLower(s) && s != strings.ToUpper(s) })
	case "isupper":
		return noArgs(func() any { return s == strings.ToUpper(s) && s != strings.ToLower(s) })
	case "startswith", "endswith":
		return func(a []any, k []kwval) (any, error) {
			if len(a) < 1 || len(a) > 3 || len(k) > 0 {
				return nil, fmt.Errorf("takes 1 to 3 positional arguments")
			}
			sub := s
			if len(a) > 1 {
				v, err := sliceValue(s, a[1], nil, nil)
				if err != nil {
					return nil, err
				}
				if len(a) > 2 {
					v, err = sliceValue(s, a[1], a[2], nil)
					if err != nil {
						return nil, err
					}
				}
				sub = v.(string)
			}
			var cands []any
			switch x := a[0].(type) {
			case string:
				cands = []any{x}
			case Tuple:
				cands = x
			default:
				return nil, fmt.Errorf("first arg must be str or a tuple of str, not %s", typeName(a[0]))
			}
			for _, c := range cands {
				cs, ok := c.(string)
				if !ok {
					return nil, fmt.Errorf("tuple for %s must only contain str, not %s", name, typeName(c))
				}
				if (name == "startswith" && strings.HasPrefix(sub, cs)) || (name == "endswith" && strings.HasSuffix(sub, cs)) {
					return true, nil
				}
			}
			return false, nil
		}
	case "split", "rsplit":
		return func(a []any, k []kwval) (any, error) {
			p, err := params(name, a, k, []string{"sep", "maxsplit"}, []any{nil, int64(-1)})
			if err != nil {
				return nil, err
			}
			sep, err := optStr(name, p[0])
			if err != nil {
				return nil, err
			}
			n, err := wantInt(name, p[1])
			if err != nil {
				return nil, err
			}
			if sep != nil && *sep == "" {
				return nil, fmt.Errorf("empty separator")
			}
			return pySplit(s, sep, int(n), name == "rsplit"), nil
		}
	case "splitlines":
		return func(a []any, k []kwval) (any, error) {
			p, err := params(name, a, k, []string{"keepends"}, []any{false})
			if err != nil {
				return nil, err
			}
			return pySplitlines(s, truthy(p[0])), nil
		}
	case "replace":
		return func(a []any, k []kwval) (any, error) {
			p, err := params(name, a, k, []string{"old", "new", "count"}, []any{required, required, int64(-1)})
			if err != nil {
				return nil, err
			}
			old, err := wantStr(name, p[0])
			if err != nil {
				return nil, err
			}
			nw, err := wantStr(name, p[1])
			if err != nil {
				return nil, err
			}
			n, err := wantInt(name, p[2])
			if err != nil {
				return nil, err
			}
			return pyReplace(s, old, nw, n), nil
		}
	case "find", "rfind", "index", "rindex", "count":
		return func(a []any, k []kwval) (any, error) {
			if len(a) != 1 || len(k) > 0 {
				return nil, fmt.Errorf("chattmpl supports only the one-argument form")
			}
			sub, err := wantStr(name, a[0])
			if err != nil {
				return nil, err
			}
			if name == "count" {
				if sub == "" {
					return int64(utf8.RuneCountInString(s) + 1), nil
				}
				return int64(strings.Count(s, sub)), nil
			}
			var i int
			if name == "find" || name == "index" {
				i = strings.Index(s, sub)
			} else {
				i = strings.LastIndex(s, sub)
			}
			if i < 0 {
				if name == "index" || name == "rindex" {
					return nil, fmt.Errorf("substring not found")
				}
				return int64(-1), nil
			}
			return int64(utf8.RuneCountInString(s[:i])), nil
		}
	case "join":
		return func(a []any, k []kwval) (any, error) {
			if len(a) != 1 {
				return nil, fmt.Errorf("takes exactly one argument")
			}
			xs, err := iterate(a[0])
			if err != nil {
				return nil, err
			}
			parts := make([]string, len(xs))
			for i, x := range xs {
				xs, ok := x.(string)
				if !ok {
					return nil, fmt.Errorf("sequence item %d: expected str instance, %s found", i, typeName(x))
				}
				parts[i] = xs
			}
			return strings.Join(parts, s), nil
		}
	case "format":
		return func(a []any, k []kwval) (any, error) { return braceFormat(s, a, k) }
	case "zfill":
		return func(a []any, k []kwval) (any, error) {
			if len(a) != 1 {
				return nil, fmt.Errorf("takes exactly one argument")
			}
			w, err := wantInt(name, a[0])
			if err != nil {
				return nil, err
			}
			n := utf8.RuneCountInString(s)
			if int(w) <= n {
				return s, nil
			}
			pad := strings.Repeat("0", int(w)-n)
			if strings.HasPrefix(s, "-") || strings.HasPrefix(s, "+") {
				return s[:1] + pad + s[1:], nil
			}
			return pad + s, nil
		}
	case "center", "ljust", "rjust":
		return func(a []any, k []kwval) (any, error) {
			p, err := params(name, a, k, []string{"width", "fillchar"}, []any{required, " "})
			if err != nil {
				return nil, err
			}
			w, err := wantInt(name, p[0])
			if err != nil {
				return nil, err
			}
			fill, err := wantStr(name, p[1])
			if err != nil || utf8.RuneCountInString(fill) != 1 {
				return nil, fmt.Errorf("the fill character must be exactly one character long")
			}
			n := utf8.RuneCountInString(s)
			if int(w) <= n {
				return s, nil
			}
			switch name {
			case "ljust":
				return s + strings.Repeat(fill, int(w)-n), nil
			case "rjust":
				return strings.Repeat(fill, int(w)-n) + s, nil
			}
			return pyCenter(s, int(w), fill), nil
		}
	case "partition", "rpartition":
		return func(a []any, k []kwval) (any, error) {
			if len(a) != 1 {
				return nil, fmt.Errorf("takes exactly one argument")
			}
			sep, err := wantStr(name, a[0])
			if err != nil {
				return nil, err
			}
			if sep == "" {
				return nil, fmt.Errorf("empty separator")
			}
			var i int
			if name == "partition" {
				i = strings.Index(s, sep)
				if i < 0 {
					return Tuple{s, "", ""}, nil
				}
			} else {
				i = strings.LastIndex(s, sep)
				if i < 0 {
					return Tuple{"", "", s}, nil
				}
			}
			return Tuple{s[:i], sep, s[i+len(sep):]}, nil
		}
	}
	return nil
}

// pyTitle is Python's str.title: a letter following a cased letter is
// lowercased, any other letter is titlecased.
func pyTitle(s string) string {
	var b strings.Builder
	prevCased := false
	for _, r := range s {
		if prevCased {
			b.WriteRune(unicode.ToLower(r))
		} else {
			b.WriteRune(unicode.ToTitle(r))
		}
		prevCased = unicode.IsUpper(r) || unicode.IsLower(r) || unicode.IsTitle(r)
	}
	return b.String()
}

func pySplit(s string, sep *string, maxsplit int, fromRight bool) []any {
	var parts []string
	if sep == nil {
		fields := strings.FieldsFunc(s, isSpace)
		if maxsplit < 0 || maxsplit >= len(fields) {
			parts = fields
		} else if !fromRight {
			// Keep the unsplit remainder verbatim (minus its leading whitespace).
			rest := strings.TrimLeftFunc(s, isSpace)
			for i := 0; i < maxsplit; i++ {
				j := strings.IndexFunc(rest, isSpace)
				parts = append(parts, rest[:j])
				rest = strings.TrimLeftFunc(rest[j:], isSpace)
			}
			parts = append(parts, rest)
		} else {
			rest := strings.TrimRightFunc(s, isSpace)
			var tail []string
			for i := 0; i < maxsplit; i++ {
				j := strings.LastIndexFunc(rest, isSpace)
				_, w := utf8.DecodeRuneInString(rest[j:])
				tail = append([]string{rest[j+w:]}, tail...)
				rest = strings.TrimRightFunc(rest[:j], isSpace)
			}
			parts = append([]string{rest}, tail...)
		}
	} else if !fromRight {
		parts = strings.SplitN(s, *sep, maxIfNeg(maxsplit))
	} else {
		all := strings.Split(s, *sep)
		if maxsplit < 0 || maxsplit >= len(all)-1 {
			parts = all
		} else {
			k := len(all) - maxsplit
			parts = append([]string{strings.Join(all[:k], *sep)}, all[k:]...)
		}
	}
	out := make([]any, len(parts))
	for i, p := range parts {
		out[i] = p
	}
	return out
}

func maxIfNeg(n int) int {
	if n < 0 {
		return -1
	}
	return n + 1
}

func pySplitlines(s string, keep bool) []any {
	out := []any{}
	start := 0
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch r {
		case '\r', '\n', '\v', '\f', 0x1c, 0x1d, 0x1e, 0x85, 0x2028, 0x2029:
			end := i + n
			if r == '\r' && end < len(s) && s[end] == '\n' {
				end++
			}
			if keep {
				out = append(out, s[start:end])
			} else {
				out = append(out, s[start:i])
			}
			start = end
			i = end
			continue
		}
		i += n
	}
	if start < len(s) {
		out = append(out, s[start:])
	}
	return out
}

// ---- globals ----

type env struct {
	globals map[string]any
	now     func() time.Time
}

// builtinGlobals are the names transformers puts in the jinja2 environment
// (raise_exception, strftime_now) plus jinja2's own (range, dict, namespace).
var builtinGlobals = map[string]any{
	"range": builtinFunc(func(_ *renderer, a []any, k []kwval) (any, error) {
		if len(k) > 0 || len(a) == 0 || len(a) > 3 {
			return nil, fmt.Errorf("range expects 1 to 3 integer arguments")
		}
		var ns [3]int64
		for i, x := range a {
			n, ok := asInt(x)
			if !ok {
				return nil, fmt.Errorf("range: '%s' object cannot be interpreted as an integer", typeName(x))
			}
			ns[i] = n
		}
		r := rangeVal{0, ns[0], 1}
		switch len(a) {
		case 2:
			r = rangeVal{ns[0], ns[1], 1}
		case 3:
			if ns[2] == 0 {
				return nil, fmt.Errorf("range() arg 3 must not be zero")
			}
			r = rangeVal{ns[0], ns[1], ns[2]}
		}
		// jinja2's sandbox caps range() at MAX_RANGE = 100000 items.
		if span := (r.stop - r.start) / r.step; span > 100000 {
			return nil, fmt.Errorf("range too big: %d items (the sandbox allows 100000)", span)
		}
		return r, nil
	}),
	"dict": builtinFunc(func(_ *renderer, a []any, k []kwval) (any, error) {
		d := NewDict()
		if len(a) > 1 {
			return nil, fmt.Errorf("dict expected at most 1 argument")
		}
		if len(a) == 1 {
			src, ok := a[0].(*Dict)
			if !ok {
				return nil, fmt.Errorf("dict() positional argument must be a dict in chattmpl")
			}
			for i, key := range src.keys {
				d.Set(key, src.vals[i])
			}
		}
		for _, kv := range k {
			d.Set(kv.name, kv.v)
		}
		return d, nil
	}),
	"namespace": builtinFunc(func(_ *renderer, a []any, k []kwval) (any, error) {
		ns := &Namespace{attrs: NewDict()}
		for _, x := range a {
			src, ok := x.(*Dict)
			if !ok {
				return nil, fmt.Errorf("namespace() positional arguments must be dicts")
			}
			for i, key := range src.keys {
				ns.attrs.Set(key, src.vals[i])
			}
		}
		for _, kv := range k {
			ns.attrs.Set(kv.name, kv.v)
		}
		return ns, nil
	}),
	"raise_exception": builtinFunc(func(_ *renderer, a []any, k []kwval) (any, error) {
		msg := ""
		if len(a) > 0 {
			msg = toStr(a[0])
		}
		return nil, &Error{Kind: ErrRaised, Msg: msg}
	}),
	"strftime_now": builtinFunc(func(r *renderer, a []any, k []kwval) (any, error) {
		if len(a) != 1 || len(k) > 0 {
			return nil, fmt.Errorf("strftime_now takes exactly one format string")
		}
		f, err := wantStr("strftime_now", a[0])
		if err != nil {
			return nil, err
		}
		return strftime(f, r.env.now())
	}),
}
