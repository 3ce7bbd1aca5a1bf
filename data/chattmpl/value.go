package chattmpl

import (
	"fmt"
	"math"
	"math/big"
	"sort"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// The evaluator works on a closed set of Go types that mirror the Python
// objects jinja2 sees when transformers renders a chat template:
//
//	nil        None
//	bool       bool
//	int64      int (Python ints are unbounded: arithmetic overflow is an error)
//	*big.Int   int beyond 64 bits from input data; printable, comparable with
//	           ==, serializable, but arithmetic on it is an error
//	float64    float
//	string     str
//	[]any      list
//	Tuple      tuple
//	*Dict      dict (insertion ordered, like Python 3.7+ dicts)
//	*Namespace jinja2's namespace()
//	Undefined  jinja2.Undefined (a missing variable, attribute or item)
//	callables  macros, globals, bound methods, loop helpers
//
// Every value that enters through Execute is converted to these types once
// (see convertInput), so the evaluator never needs reflection.

// Tuple is a Python tuple: it prints as (a, b) and serializes to a JSON array.
type Tuple []any

// Undefined is jinja2's Undefined: printing it gives "", it is falsy and
// iterates as empty, but almost any other use (attribute access, arithmetic,
// calling it) is an error that names what was missing.
type Undefined struct {
	hint string // e.g. "'x' is undefined" or "'dict object' has no attribute 'y'"
}

// Dict is an insertion-ordered Python dict. Key order matters to templates:
// tojson and items() emit keys in insertion order, exactly as Python does.
// Keys are strings, ints, floats, bools or None.
type Dict struct {
	keys  []any
	vals  []any
	index map[any]int
}

// NewDict returns an empty ordered dict.
func NewDict() *Dict { return &Dict{index: map[any]int{}} }

// dictKey normalizes a key the way Python's hash/eq do: True == 1 == 1.0.
func dictKey(k any) any {
	switch v := k.(type) {
	case bool:
		if v {
			return int64(1)
		}
		return int64(0)
	case float64:
		if v == math.Trunc(v) && math.Abs(v) < 1<<62 {
			return int64(v)
		}
	}
	return k
}

// Set inserts or replaces key k; a new key goes to the end, a replaced key
// keeps its position (Python semantics).
func (d *Dict) Set(k, v any) {
	nk := dictKey(k)
	if i, ok := d.index[nk]; ok {
		d.vals[i] = v
		return
	}
	d.index[nk] = len(d.keys)
	d.keys = append(d.keys, k)
	d.vals = append(d.vals, v)
}

// Get returns the value stored under k.
func (d *Dict) Get(k any) (any, bool) {
	if !hashable(k) {
		return nil, false
	}
	i, ok := d.index[dictKey(k)]
	if !ok {
		return nil, false
	}
	return d.vals[i], true
}

// Len returns the number of keys.
func (d *Dict) Len() int { return len(d.keys) }

// Keys returns the keys in insertion order (the slice is shared; do not modify).
func (d *Dict) Keys() []any { return d.keys }

func hashable(k any) bool {
	switch k.(type) {
	case nil, bool, int64, float64, string:
		return true
	}
	return false
}

// Namespace is the object returned by jinja2's namespace(): the only object a
// template may mutate, via {% set ns.attr = value %}.
type Namespace struct{ attrs *Dict }

// truthy is Python's bool(x).
func truthy(v any) bool {
	switch x := v.(type) {
	case nil:
		return false
	case bool:
		return x
	case int64:
		return x != 0
	case *big.Int:
		return x.Sign() != 0
	case float64:
		return x != 0
	case string:
		return x != ""
	case []any:
		return len(x) > 0
	case Tuple:
		return len(x) > 0
	case *Dict:
		return x.Len() > 0
	case Undefined:
		return false
	}
	return true
}

// typeName is Python's type(x).__name__, used in error messages so they read
// like the ones jinja2 users know.
func typeName(v any) string {
	switch v.(type) {
	case nil:
		return "NoneType"
	case bool:
		return "bool"
	case int64, *big.Int:
		return "int"
	case float64:
		return "float"
	case string:
		return "str"
	case []any:
		return "list"
	case Tuple:
		return "tuple"
	case *Dict:
		return "dict"
	case *Namespace:
		return "Namespace"
	case Undefined:
		return "Undefined"
	case *macro:
		return "Macro"
	case *loopObj:
		return "LoopContext"
	}
	return "function"
}

// toStr is Python's str(x) as jinja2 applies it to {{ x }}.
func toStr(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case Undefined:
		return ""
	}
	var b strings.Builder
	writeRepr(&b, v, false)
	return b.String()
}

// repr is Python's repr(x).
func repr(v any) string {
	var b strings.Builder
	writeRepr(&b, v, true)
	return b.String()
}

func writeRepr(b *strings.Builder, v any, quote bool) {
	switch x := v.(type) {
	case nil:
		b.WriteString("None")
	case bool:
		if x {
			b.WriteString("True")
		} else {
			b.WriteString("False")
		}
	case int64:
		b.WriteString(strconv.FormatInt(x, 10))
	case *big.Int:
		b.WriteString(x.String())
	case float64:
		b.WriteString(formatFloat(x))
	case string:
		if quote {
			writeStrRepr(b, x)
		} else {
			b.WriteString(x)
		}
	case []any:
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteString(", ")
			}
			writeRepr(b, e, true)
		}
		b.WriteByte(']')
	case Tuple:
		b.WriteByte('(')
		for i, e := range x {
			if i > 0 {
				b.WriteString(", ")
			}
			writeRepr(b, e, true)
		}
		if len(x) == 1 {
			b.WriteByte(',')
		}
		b.WriteByte(')')
	case *Dict:
		writeDictRepr(b, x)
	case *Namespace:
		b.WriteString("<Namespace ")
		writeDictRepr(b, x.attrs)
		b.WriteByte('>')
	case Undefined:
		if !quote {
			return
		}
		b.WriteString("Undefined")
	case *macro:
		fmt.Fprintf(b, "<Macro '%s'>", x.name)
	case *loopObj:
		fmt.Fprintf(b, "<LoopContext %d/%d>", x.index0+1, len(x.items))
	case rangeVal:
		if x.step == 1 {
			fmt.Fprintf(b, "range(%d, %d)", x.start, x.stop)
		} else {
			fmt.Fprintf(b, "range(%d, %d, %d)", x.start, x.stop, x.step)
		}
	default:
		fmt.Fprintf(b, "<%s>", typeName(v))
	}
}

func writeDictRepr(b *strings.Builder, d *Dict) {
	b.WriteByte('{')
	for i, k := range d.keys {
		if i > 0 {
			b.WriteString(", ")
		}
		writeRepr(b, k, true)
		b.WriteString(": ")
		writeRepr(b, d.vals[i], true)
	}
	b.WriteByte('}')
}

// writeStrRepr follows CPython's unicode_repr: single quotes unless the text
// has a single quote and no double quote; non-printable runes escaped.
func writeStrRepr(b *strings.Builder, s string) {
	q := byte('\'')
	if strings.IndexByte(s, '\'') >= 0 && strings.IndexByte(s, '"') < 0 {
		q = '"'
	}
	b.WriteByte(q)
	for _, r := range s {
		switch {
		case r == rune(q) || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(b, `\x%02x`, r)
		case r < 0x80 || pyPrintable(r):
			b.WriteRune(r)
		case r < 0x100:
			fmt.Fprintf(b, `\x%02x`, r)
		case r < 0x10000:
			fmt.Fprintf(b, `\u%04x`, r)
		default:
			fmt.Fprintf(b, `\U%08x`, r)
		}
	}
	b.WriteByte(q)
}

// pyPrintable approximates str.isprintable for non-ASCII runes: Python treats
// every separator but ' ' and every other-category rune as non-printable,
// which is what unicode.IsPrint does too.
func pyPrintable(r rune) bool { return unicode.IsPrint(r) }

// formatFloat is Python's repr(float): shortest round-trip digits, fixed
// notation for decimal exponents in [-4, 16), otherwise 1.5e+20 style.
func formatFloat(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	case math.IsNaN(f):
		return "nan"
	case f == 0:
		if math.Signbit(f) {
			return "-0.0"
		}
		return "0.0"
	}
	e := strconv.FormatFloat(f, 'e', -1, 64) // "-1.2345e+16"
	i := strings.IndexByte(e, 'e')
	exp, _ := strconv.Atoi(e[i+1:])
	if exp >= -4 && exp < 16 {
		s := strconv.FormatFloat(f, 'f', -1, 64)
		if !strings.ContainsAny(s, ".") {
			s += ".0"
		}
		return s
	}
	mant := e[:i]
	sign := "+"
	if exp < 0 {
		sign = "-"
		exp = -exp
	}
	return fmt.Sprintf("%se%s%02d", mant, sign, exp)
}

// isSpace is Python's str.isspace for one rune (it also counts the ASCII
// file/group/record/unit separators, which unicode.IsSpace does not).
func isSpace(r rune) bool {
	return unicode.IsSpace(r) || (r >= 0x1c && r <= 0x1f)
}

// pyStrip implements str.strip/lstrip/rstrip with an optional character set.
func pyStrip(s string, chars *string, left, right bool) string {
	in := isSpace
	if chars != nil {
		set := *chars
		in = func(r rune) bool { return strings.ContainsRune(set, r) }
	}
	if left {
		s = strings.TrimLeftFunc(s, in)
	}
	if right {
		s = strings.TrimRightFunc(s, in)
	}
	return s
}

// ---- equality and ordering ----

func isNumber(v any) bool {
	switch v.(type) {
	case bool, int64, float64:
		return true
	}
	return false
}

func asFloat(v any) float64 {
	switch x := v.(type) {
	case bool:
		if x {
			return 1
		}
		return 0
	case int64:
		return float64(x)
	case float64:
		return x
	}
	return math.NaN()
}

func asInt(v any) (int64, bool) {
	switch x := v.(type) {
	case bool:
		if x {
			return 1, true
		}
		return 0, true
	case int64:
		return x, true
	}
	return 0, false
}

// pyEqual is Python's ==.
func pyEqual(a, b any) bool {
	if isNumber(a) && isNumber(b) {
		ai, aok := asInt(a)
		bi, bok := asInt(b)
		if aok && bok {
			return ai == bi
		}
		return asFloat(a) == asFloat(b)
	}
	switch x := a.(type) {
	case nil:
		return b == nil
	case *big.Int:
		y, ok := b.(*big.Int)
		return ok && x.Cmp(y) == 0
	case string:
		y, ok := b.(string)
		return ok && x == y
	case []any:
		y, ok := b.([]any)
		return ok && seqEqual(x, y)
	case Tuple:
		y, ok := b.(Tuple)
		return ok && seqEqual(x, y)
	case *Dict:
		y, ok := b.(*Dict)
		if !ok || x.Len() != y.Len() {
			return false
		}
		for i, k := range x.keys {
			w, ok := y.Get(k)
			if !ok || !pyEqual(x.vals[i], w) {
				return false
			}
		}
		return true
	case Undefined:
		_, ok := b.(Undefined)
		return ok
	}
	return a == b
}

func seqEqual(x, y []any) bool {
	if len(x) != len(y) {
		return false
	}
	for i := range x {
		if !pyEqual(x[i], y[i]) {
			return false
		}
	}
	return true
}

// pyCompare returns -1, 0, +1 for a<b, a==b, a>b under Python ordering rules,
// or an error for types Python cannot order.
func pyCompare(a, b any, op string) (int, error) {
	if isNumber(a) && isNumber(b) {
		ai, aok := asInt(a)
		bi, bok := asInt(b)
		if aok && bok {
			return cmp3(ai < bi, ai > bi), nil
		}
		fa, fb := asFloat(a), asFloat(b)
		return cmp3(fa < fb, fa > fb), nil
	}
	switch x := a.(type) {
	case string:
		if y, ok := b.(string); ok {
			return strings.Compare(x, y), nil // UTF-8 byte order == code point order
		}
	case []any:
		if y, ok := b.([]any); ok {
			return seqCompare(x, y, op)
		}
	case Tuple:
		if y, ok := b.(Tuple); ok {
			return seqCompare(x, y, op)
		}
	}
	if u, ok := a.(Undefined); ok {
		return 0, undefErr(u)
	}
	if u, ok := b.(Undefined); ok {
		return 0, undefErr(u)
	}
	return 0, fmt.Errorf("'%s' not supported between instances of '%s' and '%s'", op, typeName(a), typeName(b))
}

func cmp3(lt, gt bool) int {
	if lt {
		return -1
	}
	if gt {
		return 1
	}
	return 0
}

func seqCompare(x, y []any, op string) (int, error) {
	for i := 0; i < len(x) && i < len(y); i++ {
		if pyEqual(x[i], y[i]) {
			continue
		}
		return pyCompare(x[i], y[i], op)
	}
	return cmp3(len(x) < len(y), len(x) > len(y)), nil
}

// sortValues sorts vs in place with Python ordering; key maps each element to
// its sort key.
func sortValues(vs []any, key func(any) (any, error), reverse bool) error {
	keys := make([]any, len(vs))
	for i, v := range vs {
		k, err := key(v)
		if err != nil {
			return err
		}
		keys[i] = k
	}
	idx := make([]int, len(vs))
	for i := range idx {
		idx[i] = i
	}
	var firstErr error
	sort.SliceStable(idx, func(i, j int) bool {
		c, err := pyCompare(keys[idx[i]], keys[idx[j]], "<")
		if err != nil && firstErr == nil {
			firstErr = err
		}
		if reverse {
			return c > 0
		}
		return c < 0
	})
	if firstErr != nil {
		return firstErr
	}
	out := make([]any, len(vs))
	for i, j := range idx {
		out[i] = vs[j]
	}
	copy(vs, out)
	return nil
}

// ---- sequences ----

// iterate returns the elements a Python for-loop over v would visit.
func iterate(v any) ([]any, error) {
	switch x := v.(type) {
	case []any:
		return x, nil
	case Tuple:
		return x, nil
	case string:
		out := make([]any, 0, utf8.RuneCountInString(x))
		for _, r := range x {
			out = append(out, string(r))
		}
		return out, nil
	case *Dict:
		return append([]any(nil), x.keys...), nil
	case Undefined:
		return nil, nil
	case rangeVal:
		return x.list(), nil
	}
	return nil, fmt.Errorf("'%s' object is not iterable", typeName(v))
}

// pyLen is Python's len().
func pyLen(v any) (int, error) {
	switch x := v.(type) {
	case string:
		return utf8.RuneCountInString(x), nil
	case []any:
		return len(x), nil
	case Tuple:
		return len(x), nil
	case *Dict:
		return x.Len(), nil
	case Undefined:
		return 0, nil
	case rangeVal:
		return len(x.list()), nil
	}
	return 0, fmt.Errorf("object of type '%s' has no len()", typeName(v))
}

// rangeVal is Python's range object (printed as range(a, b)).
type rangeVal struct{ start, stop, step int64 }

func (r rangeVal) list() []any {
	var out []any
	for i := r.start; (r.step > 0 && i < r.stop) || (r.step < 0 && i > r.stop); i += r.step {
		out = append(out, i)
	}
	return out
}

// sliceIndices is Python's slice.indices(n).
func sliceIndices(n int, start, stop, step any) (int, int, int, error) {
	st := 1
	if step != nil {
		s, ok := asInt(step)
		if !ok {
			return 0, 0, 0, fmt.Errorf("slice indices must be integers or None, not %s", typeName(step))
		}
		if s == 0 {
			return 0, 0, 0, fmt.Errorf("slice step cannot be zero")
		}
		st = int(s)
	}
	get := func(v any, def int) (int, error) {
		if v == nil {
			return def, nil
		}
		i, ok := asInt(v)
		if !ok {
			return 0, fmt.Errorf("slice indices must be integers or None, not %s", typeName(v))
		}
		x := int(i)
		if x < 0 {
			x += n
			if x < 0 {
				if st < 0 {
					x = -1
				} else {
					x = 0
				}
			}
		} else if x >= n {
			if st < 0 {
				x = n - 1
			} else {
				x = n
			}
		}
		return x, nil
	}
	var lo, hi int
	var err error
	if st > 0 {
		if lo, err = get(start, 0); err != nil {
			return 0, 0, 0, err
		}
		if hi, err = get(stop, n); err != nil {
			return 0, 0, 0, err
		}
	} else {
		if lo, err = get(start, n-1); err != nil {
			return 0, 0, 0, err
		}
		if hi, err = get(stop, -1); err != nil {
			return 0, 0, 0, err
		}
	}
	return lo, hi, st, nil
}

func sliceAny(xs []any, lo, hi, st int) []any {
	out := []any{}
	if st > 0 {
		for i := lo; i < hi; i += st {
			out = append(out, xs[i])
		}
	} else {
		for i := lo; i > hi; i += st {
			out = append(out, xs[i])
		}
	}
	return out
}

func sliceValue(v any, start, stop, step any) (any, error) {
	switch x := v.(type) {
	case []any:
		lo, hi, st, err := sliceIndices(len(x), start, stop, step)
		if err != nil {
			return nil, err
		}
		return sliceAny(x, lo, hi, st), nil
	case Tuple:
		lo, hi, st, err := sliceIndices(len(x), start, stop, step)
		if err != nil {
			return nil, err
		}
		return Tuple(sliceAny(x, lo, hi, st)), nil
	case string:
		rs := []rune(x)
		lo, hi, st, err := sliceIndices(len(rs), start, stop, step)
		if err != nil {
			return nil, err
		}
		var b strings.Builder
		if st > 0 {
			for i := lo; i < hi; i += st {
				b.WriteRune(rs[i])
			}
		} else {
			for i := lo; i > hi; i += st {
				b.WriteRune(rs[i])
			}
		}
		return b.String(), nil
	case Undefined:
		return nil, undefErr(x)
	}
	return nil, fmt.Errorf("'%s' object is not subscriptable", typeName(v))
}
