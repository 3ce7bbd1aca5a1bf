package chattmpl

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"reflect"
	"sort"
	"strings"
	"time"
	"unicode/utf8"
)

// Sentinel errors; every error returned by this package wraps one of them.
var (
	// ErrSyntax: the template is not valid Jinja (unclosed tag, bad
	// expression, unknown tag).
	ErrSyntax = errors.New("chattmpl: template syntax error")
	// ErrUnsupported: valid Jinja that chattmpl does not implement.
	ErrUnsupported = errors.New("chattmpl: unsupported template construct")
	// ErrRender: the template failed while rendering (type error, undefined
	// value used, ...), as jinja2 would.
	ErrRender = errors.New("chattmpl: render error")
	// ErrRaised: the template called raise_exception(msg); Error.Msg is msg.
	ErrRaised = errors.New("chattmpl: template raised an exception")
	// ErrInput: a variable passed to Execute/Render cannot be represented.
	ErrInput = errors.New("chattmpl: invalid input value")
)

// Error is a compile or render error located at a template line.
type Error struct {
	Kind error  // one of the sentinels above
	Line int    // 1-based template line, 0 if unknown
	Msg  string // what went wrong
	err  error  // underlying cause, if any
}

func (e *Error) Error() string {
	prefix := map[error]string{
		ErrSyntax:      "chattmpl: syntax error",
		ErrUnsupported: "chattmpl: unsupported",
		ErrRender:      "chattmpl: render error",
		ErrRaised:      "chattmpl: template raised exception",
		ErrInput:       "chattmpl: invalid input",
	}[e.Kind]
	if e.Line > 0 {
		return fmt.Sprintf("%s at template line %d: %s", prefix, e.Line, e.Msg)
	}
	return fmt.Sprintf("%s: %s", prefix, e.Msg)
}

// Unwrap exposes the sentinel (and the cause) to errors.Is/As.
func (e *Error) Unwrap() []error {
	if e.err != nil {
		return []error{e.Kind, e.err}
	}
	return []error{e.Kind}
}

// Template is a compiled chat template. It is immutable and safe for
// concurrent use.
type Template struct {
	body []node
}

// Compile parses a chat template. Unknown tags, filters and tests are
// reported here with their line.
func Compile(src string) (*Template, error) {
	if !utf8.ValidString(src) {
		return nil, &Error{Kind: ErrSyntax, Msg: "template source is not valid UTF-8"}
	}
	toks, err := lex(src)
	if err != nil {
		return nil, err
	}
	body, err := parseTemplate(toks)
	if err != nil {
		return nil, err
	}
	return &Template{body: body}, nil
}

// Span is a byte range [Start, End) of the rendered text.
type Span struct{ Start, End int }

// Execute renders the template with arbitrary variables (converted as
// described in the package doc). strftime_now uses the current time.
func (t *Template) Execute(vars map[string]any) (string, error) {
	s, _, err := t.execute(vars, time.Now)
	return s, err
}

// execute renders with vars; converted says they already hold only the
// evaluator's value types (Render builds them that way), saving a deep copy.
func (t *Template) execute(vars map[string]any, now func() time.Time, converted ...bool) (string, []Span, error) {
	root := &scope{vars: make([]binding, 0, len(vars))}
	for _, k := range sortedKeys(vars) {
		v := vars[k]
		if len(converted) == 0 || !converted[0] {
			var err error
			if v, err = convertInput(v, k); err != nil {
				return "", nil, err
			}
		}
		root.set(k, v)
	}
	var b strings.Builder
	var spans []Span
	r := &renderer{out: &b, env: &env{globals: builtinGlobals, now: now}}
	r.genOn = func(start bool, pos int) {
		if start {
			spans = append(spans, Span{Start: pos, End: -1})
		} else {
			for i := len(spans) - 1; i >= 0; i-- {
				if spans[i].End < 0 {
					spans[i].End = pos
					break
				}
			}
		}
	}
	if err := r.execBody(t.body, root); err != nil {
		if _, ok := err.(errLoopCtl); ok {
			return "", nil, &Error{Kind: ErrSyntax, Msg: "{% break %} or {% continue %} outside of a for loop"}
		}
		return "", nil, err
	}
	return b.String(), spans, nil
}

// Message is one chat turn. It becomes the dict the template sees as
// messages[i], with keys in this order: role, content, reasoning_content
// (only if non-empty), tool_calls (only if non-nil), then Extra's keys in
// sorted order. Extra may override any of them, e.g. {"content": nil} for a
// null content or {"reasoning_content": ""} for an explicitly empty one
// (Qwen3's template treats a present-but-empty reasoning_content differently
// from a missing one).
type Message struct {
	Role             string
	Content          string
	ReasoningContent string
	// ToolCalls are OpenAI-style {"type": "function", "function": {"name":
	// ..., "arguments": {...}}} objects. Use *Dict values (e.g. from
	// ParseJSON) to keep key order; map[string]any keys are sorted.
	ToolCalls []any
	Extra     map[string]any
}

// Options are the keyword arguments of apply_chat_template.
type Options struct {
	AddGenerationPrompt bool
	// BOSToken and EOSToken are passed as bos_token/eos_token; an empty
	// string leaves the variable undefined, as transformers does for a
	// tokenizer whose token is None (Qwen3 has no bos_token).
	BOSToken, EOSToken string
	// Tools is passed as tools (None when nil): JSON-schema tool specs.
	Tools []any
	// Documents is passed as documents (None when nil).
	Documents []any
	// ContinueFinalMessage cuts the output right after the final message's
	// content, as transformers' continue_final_message=True does.
	ContinueFinalMessage bool
	// Extra holds further template variables: enable_thinking, date_string,
	// other special tokens (pad_token, ...). They override the above.
	Extra map[string]any
	// Now is the time strftime_now sees; zero means the current time.
	Now time.Time
}

// Render renders msgs the way transformers' apply_chat_template(msgs,
// tokenize=False, ...) does.
func (t *Template) Render(msgs []Message, opts Options) (string, error) {
	s, _, err := t.RenderSpans(msgs, opts)
	return s, err
}

// RenderSpans is Render that also returns the byte spans produced inside
// {% generation %} blocks, which transformers uses for
// return_assistant_tokens_mask. Templates without such blocks return none.
func (t *Template) RenderSpans(msgs []Message, opts Options) (string, []Span, error) {
	vars, err := chatVars(msgs, opts)
	if err != nil {
		return "", nil, err
	}
	now := time.Now
	if !opts.Now.IsZero() {
		now = func() time.Time { return opts.Now }
	}
	out, spans, err := t.execute(vars, now, true)
	if err != nil {
		return "", nil, err
	}
	if opts.ContinueFinalMessage {
		if out, err = continueFinal(out, msgs); err != nil {
			return "", nil, err
		}
		kept := spans[:0]
		for _, s := range spans {
			if s.Start < len(out) {
				s.End = min(s.End, len(out))
				kept = append(kept, s)
			}
		}
		spans = kept
	}
	return out, spans, nil
}

func chatVars(msgs []Message, opts Options) (map[string]any, error) {
	list := make([]any, len(msgs))
	for i, m := range msgs {
		d := NewDict()
		if !utf8.ValidString(m.Role) || !utf8.ValidString(m.Content) || !utf8.ValidString(m.ReasoningContent) {
			return nil, &Error{Kind: ErrInput, Msg: fmt.Sprintf("messages[%d]: text is not valid UTF-8", i)}
		}
		d.Set("role", m.Role)
		d.Set("content", m.Content)
		if m.ReasoningContent != "" {
			d.Set("reasoning_content", m.ReasoningContent)
		}
		if m.ToolCalls != nil {
			tc, err := convertInput(m.ToolCalls, fmt.Sprintf("messages[%d].tool_calls", i))
			if err != nil {
				return nil, err
			}
			d.Set("tool_calls", tc)
		}
		for _, k := range sortedKeys(m.Extra) {
			v, err := convertInput(m.Extra[k], fmt.Sprintf("messages[%d].%s", i, k))
			if err != nil {
				return nil, err
			}
			d.Set(k, v)
		}
		list[i] = d
	}
	vars := map[string]any{
		"messages":              list,
		"add_generation_prompt": opts.AddGenerationPrompt,
		"tools":                 nil,
		"documents":             nil,
	}
	if opts.Tools != nil {
		v, err := convertInput(opts.Tools, "tools")
		if err != nil {
			return nil, err
		}
		vars["tools"] = v
	}
	if opts.Documents != nil {
		v, err := convertInput(opts.Documents, "documents")
		if err != nil {
			return nil, err
		}
		vars["documents"] = v
	}
	if opts.BOSToken != "" {
		vars["bos_token"] = opts.BOSToken
	}
	if opts.EOSToken != "" {
		vars["eos_token"] = opts.EOSToken
	}
	for k, v := range opts.Extra {
		c, err := convertInput(v, k)
		if err != nil {
			return nil, err
		}
		vars[k] = c
	}
	return vars, nil
}

// continueFinal mirrors transformers' continue_final_message handling.
func continueFinal(out string, msgs []Message) (string, error) {
	if len(msgs) == 0 {
		return "", &Error{Kind: ErrInput, Msg: "ContinueFinalMessage needs at least one message"}
	}
	final := msgs[len(msgs)-1].Content
	trimmed := strings.TrimFunc(final, isSpace)
	loc := strings.LastIndex(out, trimmed)
	if loc < 0 {
		return "", &Error{Kind: ErrInput, Msg: "ContinueFinalMessage is set but the final message does not appear in the rendered chat; this template cannot continue a final message"}
	}
	left := strings.TrimLeftFunc(final, isSpace)
	if end := loc + len(left); end <= len(out) && out[loc:end] == final {
		return out[:end], nil
	}
	return out[:loc+len(trimmed)], nil
}

// convertInput turns a Go value into the evaluator's value types; path names
// the variable in errors ("messages[2].tool_calls[0].function").
func convertInput(v any, path string) (any, error) {
	bad := func(format string, args ...any) error {
		return &Error{Kind: ErrInput, Msg: path + ": " + fmt.Sprintf(format, args...)}
	}
	switch x := v.(type) {
	case nil, bool, int64, float64, *big.Int:
		return x, nil
	case string:
		if !utf8.ValidString(x) {
			return nil, bad("string is not valid UTF-8 (Python strings hold Unicode text)")
		}
		return x, nil
	case int:
		return int64(x), nil
	case int32:
		return int64(x), nil
	case float32:
		return float64(x), nil
	case json.Number:
		n, err := parseJSONNumber(string(x))
		if err != nil {
			return nil, bad("%v", err)
		}
		return n, nil
	case json.RawMessage:
		n, err := ParseJSON(x)
		if err != nil {
			return nil, bad("%v", err)
		}
		return n, nil
	case Undefined:
		return x, nil
	case *Dict:
		d := NewDict()
		for i, k := range x.keys {
			if !hashable(k) {
				return nil, bad("dict key of type %T is not hashable", k)
			}
			cv, err := convertInput(x.vals[i], fmt.Sprintf("%s.%v", path, k))
			if err != nil {
				return nil, err
			}
			d.Set(k, cv)
		}
		return d, nil
	case Tuple:
		out := make(Tuple, len(x))
		for i, e := range x {
			c, err := convertInput(e, fmt.Sprintf("%s[%d]", path, i))
			if err != nil {
				return nil, err
			}
			out[i] = c
		}
		return out, nil
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			c, err := convertInput(e, fmt.Sprintf("%s[%d]", path, i))
			if err != nil {
				return nil, err
			}
			out[i] = c
		}
		return out, nil
	case map[string]any:
		d := NewDict()
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			c, err := convertInput(x[k], path+"."+k)
			if err != nil {
				return nil, err
			}
			d.Set(k, c)
		}
		return d, nil
	case []Message:
		vars, err := chatVars(x, Options{})
		if err != nil {
			return nil, err
		}
		return vars["messages"], nil
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return rv.Int(), nil
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		u := rv.Uint()
		if u > 1<<63-1 {
			return nil, bad("unsigned integer %d does not fit in int64", u)
		}
		return int64(u), nil
	case reflect.Float32, reflect.Float64:
		return rv.Float(), nil
	case reflect.Bool:
		return rv.Bool(), nil
	case reflect.String:
		return convertInput(rv.String(), path)
	case reflect.Slice, reflect.Array:
		out := make([]any, rv.Len())
		for i := range out {
			c, err := convertInput(rv.Index(i).Interface(), fmt.Sprintf("%s[%d]", path, i))
			if err != nil {
				return nil, err
			}
			out[i] = c
		}
		return out, nil
	case reflect.Map:
		if rv.Type().Key().Kind() != reflect.String {
			return nil, bad("map keys must be strings, got %s", rv.Type().Key())
		}
		m := map[string]any{}
		iter := rv.MapRange()
		for iter.Next() {
			m[iter.Key().String()] = iter.Value().Interface()
		}
		return convertInput(m, path)
	case reflect.Pointer, reflect.Interface:
		if rv.IsNil() {
			return nil, nil
		}
		return convertInput(rv.Elem().Interface(), path)
	}
	return nil, bad("unsupported Go type %T; pass strings, numbers, bools, nil, slices, map[string]any, *chattmpl.Dict or values from ParseJSON", v)
}

// ParseMessages decodes a JSON array of OpenAI-style chat messages
// ([{"role": ..., "content": ...}, ...]) into Messages, keeping the key order
// of nested objects (tool call arguments) as Python's json.loads would.
func ParseMessages(data []byte) ([]Message, error) {
	v, err := ParseJSON(data)
	if err != nil {
		return nil, err
	}
	return MessagesFromValue(v)
}

// MessagesFromValue converts a value from ParseJSON (a list of dicts) into
// Messages. A string content goes to Content; null or structured content
// (multimodal parts) goes to Extra["content"] so the template sees it as is.
func MessagesFromValue(v any) ([]Message, error) {
	list, ok := v.([]any)
	if !ok {
		return nil, &Error{Kind: ErrInput, Msg: fmt.Sprintf("messages: expected a JSON array of message objects, got %s", typeName(v))}
	}
	out := make([]Message, len(list))
	for i, e := range list {
		d, ok := e.(*Dict)
		if !ok {
			return nil, &Error{Kind: ErrInput, Msg: fmt.Sprintf("messages[%d]: expected an object, got %s", i, typeName(e))}
		}
		m := &out[i]
		for j, k := range d.keys {
			key, ok := k.(string)
			if !ok {
				return nil, &Error{Kind: ErrInput, Msg: fmt.Sprintf("messages[%d]: non-string key %s", i, repr(k))}
			}
			val := d.vals[j]
			s, isStr := val.(string)
			switch {
			case key == "role":
				if !isStr {
					return nil, &Error{Kind: ErrInput, Msg: fmt.Sprintf("messages[%d].role: expected a string, got %s", i, typeName(val))}
				}
				m.Role = s
			case key == "content" && isStr:
				m.Content = s
			case key == "reasoning_content" && isStr && s != "":
				m.ReasoningContent = s
			case key == "tool_calls" && val != nil:
				tc, ok := val.([]any)
				if !ok {
					return nil, &Error{Kind: ErrInput, Msg: fmt.Sprintf("messages[%d].tool_calls: expected an array, got %s", i, typeName(val))}
				}
				m.ToolCalls = tc
			default:
				if m.Extra == nil {
					m.Extra = map[string]any{}
				}
				m.Extra[key] = val
			}
		}
		if _, ok := d.Get("role"); !ok {
			return nil, &Error{Kind: ErrInput, Msg: fmt.Sprintf("messages[%d]: missing \"role\"", i)}
		}
	}
	return out, nil
}
