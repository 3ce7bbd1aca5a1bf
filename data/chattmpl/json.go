package chattmpl

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/big"
	"strconv"
	"strings"
	"unicode/utf8"
)

// filterToJSON is transformers' replacement for jinja2's tojson:
// json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False). Unlike jinja2's own filter it does not HTML-escape.
func filterToJSON(_ *renderer, v any, a []any, k []kwval) (any, error) {
	p, err := params("tojson", a, k, []string{"ensure_ascii", "indent", "separators", "sort_keys"}, []any{false, nil, nil, false})
	if err != nil {
		return nil, err
	}
	e := jsonEnc{ensureASCII: truthy(p[0]), sortKeys: truthy(p[3])}
	switch ind := p[1].(type) {
	case nil:
	case string:
		e.indent, e.pretty = ind, true
	case int64, bool:
		n, _ := asInt(ind)
		e.indent, e.pretty = strings.Repeat(" ", int(max(n, 0))), true
	default:
		return nil, fmt.Errorf("indent must be an int or a string, got %s", typeName(p[1]))
	}
	// Python's defaults: (', ', ': ') without indent, (',', ': ') with it.
	e.itemSep, e.keySep = ", ", ": "
	if e.pretty {
		e.itemSep = ","
	}
	if p[2] != nil {
		seps, err := iterate(p[2])
		if err != nil || len(seps) != 2 {
			return nil, fmt.Errorf("separators must be a (item_separator, key_separator) pair")
		}
		is, ok1 := seps[0].(string)
		ks, ok2 := seps[1].(string)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("separators must be strings")
		}
		e.itemSep, e.keySep = is, ks
	}
	var b strings.Builder
	if err := e.encode(&b, v, 0); err != nil {
		return nil, err
	}
	return b.String(), nil
}

type jsonEnc struct {
	ensureASCII, sortKeys, pretty bool
	indent, itemSep, keySep       string
}

func (e *jsonEnc) newline(b *strings.Builder, level int) {
	if e.pretty {
		b.WriteByte('\n')
		for i := 0; i < level; i++ {
			b.WriteString(e.indent)
		}
	}
}

func (e *jsonEnc) encode(b *strings.Builder, v any, level int) error {
	switch x := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		if x {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case int64:
		b.WriteString(strconv.FormatInt(x, 10))
	case *big.Int:
		b.WriteString(x.String())
	case float64:
		b.WriteString(jsonFloat(x))
	case string:
		writeJSONString(b, x, e.ensureASCII)
	case []any:
		return e.encodeList(b, x, level)
	case Tuple:
		return e.encodeList(b, x, level)
	case *Dict:
		if x.Len() == 0 {
			b.WriteString("{}")
			return nil
		}
		order := make([]int, x.Len())
		for i := range order {
			order[i] = i
		}
		if e.sortKeys {
			keys := make([]any, len(order))
			for i := range order {
				keys[i] = int64(i)
			}
			if err := sortValues(keys, func(i any) (any, error) { return x.keys[i.(int64)], nil }, false); err != nil {
				return err
			}
			for i, k := range keys {
				order[i] = int(k.(int64))
			}
		}
		b.WriteByte('{')
		for n, i := range order {
			if n > 0 {
				b.WriteString(e.itemSep)
			}
			e.newline(b, level+1)
			var ks string
			switch k := x.keys[i].(type) {
			case string:
				ks = k
			case nil, bool, int64:
				ks = strings.ToLower(toStr(k))
				if k == nil {
					ks = "null"
				}
			case float64:
				ks = jsonFloat(k)
			default:
				return fmt.Errorf("keys must be str, int, float, bool or None, not %s", typeName(k))
			}
			writeJSONString(b, ks, e.ensureASCII)
			b.WriteString(e.keySep)
			if err := e.encode(b, x.vals[i], level+1); err != nil {
				return err
			}
		}
		e.newline(b, level)
		b.WriteByte('}')
	default:
		return fmt.Errorf("Object of type %s is not JSON serializable", typeName(v))
	}
	return nil
}

func (e *jsonEnc) encodeList(b *strings.Builder, xs []any, level int) error {
	if len(xs) == 0 {
		b.WriteString("[]")
		return nil
	}
	b.WriteByte('[')
	for i, x := range xs {
		if i > 0 {
			b.WriteString(e.itemSep)
		}
		e.newline(b, level+1)
		if err := e.encode(b, x, level+1); err != nil {
			return err
		}
	}
	e.newline(b, level)
	b.WriteByte(']')
	return nil
}

// jsonFloat is float.__repr__ with json's spellings of the non-finite values.
func jsonFloat(f float64) string {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	}
	return formatFloat(f)
}

// writeJSONString follows Python's json encoder: only '"', '\\' and control
// characters are escaped when ensure_ascii is false (DEL and U+2028 stay raw).
func writeJSONString(b *strings.Builder, s string, ensureASCII bool) {
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			switch {
			case r < 0x20:
				fmt.Fprintf(b, `\u%04x`, r)
			case ensureASCII && r > 0x7e:
				if r > 0xffff {
					r -= 0x10000
					fmt.Fprintf(b, `\u%04x\u%04x`, 0xd800+(r>>10), 0xdc00+(r&0x3ff))
				} else {
					fmt.Fprintf(b, `\u%04x`, r)
				}
			default:
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
}

// ParseJSON decodes JSON into the values templates see, as Python's
// json.loads would build them: objects become *Dict with their key order
// kept (tojson and items() depend on it), integers become int64 and numbers
// with a fraction or exponent become float64. Use it for tool calls, tool
// schemas and any other structured message fields.
func ParseJSON(data []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	v, err := decodeJSON(dec)
	if err != nil {
		return nil, fmt.Errorf("%w: JSON at byte %d: %v", ErrInput, dec.InputOffset(), err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("%w: trailing data after JSON value at byte %d", ErrInput, dec.InputOffset())
	}
	return v, nil
}

func decodeJSON(dec *json.Decoder) (any, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '[':
			out := []any{}
			for dec.More() {
				v, err := decodeJSON(dec)
				if err != nil {
					return nil, err
				}
				out = append(out, v)
			}
			_, err := dec.Token()
			return out, err
		case '{':
			d := NewDict()
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return nil, err
				}
				v, err := decodeJSON(dec)
				if err != nil {
					return nil, err
				}
				d.Set(kt.(string), v)
			}
			_, err := dec.Token()
			return d, err
		}
		return nil, fmt.Errorf("unexpected %v", t)
	case json.Number:
		return parseJSONNumber(string(t))
	case string:
		if !utf8.ValidString(t) {
			return nil, fmt.Errorf("invalid UTF-8 in string")
		}
		return t, nil
	}
	return tok, nil // nil, bool
}

func parseJSONNumber(s string) (any, error) {
	if !strings.ContainsAny(s, ".eE") {
		i, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			// Python ints are unbounded (Llama 3's tokenizer_config.json has
			// model_max_length = 1000000000000000019884624838656).
			b, ok := new(big.Int).SetString(s, 10)
			if !ok {
				return nil, fmt.Errorf("bad integer %s", s)
			}
			return b, nil
		}
		return i, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil && !math.IsInf(f, 0) { // Python turns 1e400 into inf too
		return nil, fmt.Errorf("bad number %s", s)
	}
	return f, nil
}
