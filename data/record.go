package data

import (
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"

	"distill/data/chattmpl"
	"distill/internal/errkind"
)

// Message is one chat turn as read from a dataset. It mirrors
// chattmpl.Message so the data readers do not depend on the template engine.
type Message struct {
	Role             string
	Content          string
	ReasoningContent string         // "reasoning_content", used by Qwen3-style templates
	ToolCalls        []any          // "tool_calls" of an assistant turn: objects (map or *chattmpl.Dict)
	Extra            map[string]any // every other key of the message (name, tool_call_id, ...)
}

// ColumnMap renames the fields a source's records are read from. Empty
// names take the defaults shown; a source needs only the fields of its record
// shape.
type ColumnMap struct {
	Messages string // "messages": a list of {role, content} objects (chat)
	Prompt   string // "prompt" (prompt/response)
	Response string // "response" (prompt/response)
	System   string // "system": optional system prompt of a prompt/response record
	Text     string // "text" (plain text, all tokens are targets)
	InputIDs string // "input_ids": pre-tokenized ids
	LossMask string // "loss_mask": optional 0/1 per id of a pre-tokenized record
	Role     string // "role": key of the role inside each message
	Content  string // "content": key of the content inside each message
	// Roles maps dataset role names to template roles, e.g. ShareGPT's
	// {"human": "user", "gpt": "assistant"}; roles must end up in
	// system, user, assistant or tool.
	Roles map[string]string
}

func (c ColumnMap) withDefaults() ColumnMap {
	def := func(s *string, d string) {
		if *s == "" {
			*s = d
		}
	}
	def(&c.Messages, "messages")
	def(&c.Prompt, "prompt")
	def(&c.Response, "response")
	def(&c.System, "system")
	def(&c.Text, "text")
	def(&c.InputIDs, "input_ids")
	def(&c.LossMask, "loss_mask")
	def(&c.Role, "role")
	def(&c.Content, "content")
	return c
}

// Check reports a role mapping that no record could satisfy: an empty
// dataset role, or a target that is not system, user, assistant or tool.
// Open checks every source's mapping; commands call it to fail before the
// tokenizer loads.
func (c ColumnMap) Check() error {
	for from, to := range c.Roles {
		if from == "" || !knownRoles[to] {
			return errkind.Errorf(ErrOptions, "role mapping %q -> %q: want DATASET_ROLE -> one of system, user, assistant, tool (e.g. human -> user)", from, to)
		}
	}
	return nil
}

// knownRoles are the roles every HF chat template understands.
var knownRoles = map[string]bool{"system": true, "user": true, "assistant": true, "tool": true}

type recordKind uint8

const (
	kindChat recordKind = iota + 1
	kindPromptResponse
	kindText
	kindTokens
)

// record is one parsed dataset row before tokenization.
type record struct {
	kind     recordKind
	messages []Message
	tools    any // record-level "tools", handed to the template
	system   string
	prompt   string
	response string
	text     string
	ids      []int32
	mask     []uint8 // nil: every id is a target
}

// parseRecord turns a decoded row (JSON object, CSV row or Parquet row, all
// as map[string]any with json.Number/int64/float64 numbers) into a record.
// The shape is chosen by which fields are present, in this order: messages,
// input_ids, prompt/response, text. pretok (a pre-tokenized dataset: no
// tokenizer reads it) takes only input_ids records: one with text and no
// ids would otherwise become an empty sample without a word. Text beside
// the ids is left unread: datasets tokenized by HF's datasets.map keep
// their text columns, and the ids are what a pre-tokenized dataset means.
func parseRecord(obj map[string]any, c ColumnMap, pretok bool) (*record, error) {
	if pretok {
		return parsePretokenized(obj, c)
	}
	switch {
	case obj[c.Messages] != nil:
		return parseChat(obj, c)
	case obj[c.InputIDs] != nil:
		return parseTokens(obj, c)
	case obj[c.Prompt] != nil || obj[c.Response] != nil:
		r := &record{kind: kindPromptResponse}
		var err error
		if r.prompt, err = stringField(obj, c.Prompt, true); err != nil {
			return nil, err
		}
		if r.response, err = stringField(obj, c.Response, true); err != nil {
			return nil, err
		}
		if r.system, err = stringField(obj, c.System, false); err != nil {
			return nil, err
		}
		if strings.TrimSpace(r.response) == "" {
			return nil, badf(c.Response, "empty response", "the response is empty, so the sample has nothing to train on")
		}
		return r, nil
	case obj[c.Text] != nil:
		t, err := stringField(obj, c.Text, true)
		if err != nil {
			return nil, err
		}
		if t == "" {
			return nil, badf(c.Text, "empty text", "the text is empty")
		}
		return &record{kind: kindText, text: t}, nil
	}
	return nil, badf("", "missing fields",
		"record has none of %q, %q, %q/%q, %q (its non-null keys: %s); rename your fields or set the source's column mapping",
		c.Messages, c.InputIDs, c.Prompt, c.Response, c.Text, nonNullKeys(obj))
}

func stringField(obj map[string]any, key string, required bool) (string, error) {
	v, ok := obj[key]
	if !ok || v == nil {
		if required {
			return "", badf(key, "missing field", "required string field %q is absent or null", key)
		}
		return "", nil
	}
	s, ok := v.(string)
	if !ok {
		return "", badf(key, "wrong type", "want a string, found %s", typeName(v))
	}
	if !utf8.ValidString(s) {
		return "", badf(key, "invalid UTF-8", "the string is not valid UTF-8; re-encode the dataset as UTF-8")
	}
	return s, nil
}

func parseChat(obj map[string]any, c ColumnMap) (*record, error) {
	list, ok := obj[c.Messages].([]any)
	if !ok {
		return nil, badf(c.Messages, "wrong type", "want a list of {%q, %q} objects, found %s", c.Role, c.Content, typeName(obj[c.Messages]))
	}
	if len(list) == 0 {
		return nil, badf(c.Messages, "empty conversation", "the conversation has no messages")
	}
	r := &record{kind: kindChat, messages: make([]Message, len(list)), tools: obj["tools"]}
	assistant := false
	for i, v := range list {
		field := fmt.Sprintf("%s[%d]", c.Messages, i)
		m, ok := asMap(v)
		if !ok {
			return nil, badf(field, "wrong type", "want a {%q, %q} object, found %s", c.Role, c.Content, typeName(v))
		}
		role, err := stringField(m, c.Role, true)
		if err != nil {
			return nil, prefixField(err, field)
		}
		if mapped, ok := c.Roles[role]; ok {
			role = mapped
		}
		if !knownRoles[role] {
			return nil, badf(field+"."+c.Role, "unknown role",
				"role %q is not one of system, user, assistant, tool; map it with the column mapping's Roles (e.g. human->user, gpt->assistant)", role)
		}
		content, err := stringField(m, c.Content, false)
		if err != nil {
			return nil, prefixField(err, field)
		}
		msg := Message{Role: role, Content: content}
		for k, x := range m {
			switch k {
			case c.Role, c.Content:
			case "reasoning_content":
				if msg.ReasoningContent, err = stringField(m, k, false); err != nil {
					return nil, prefixField(err, field)
				}
			case "tool_calls":
				if x == nil {
					continue
				}
				calls, ok := x.([]any)
				if !ok {
					return nil, badf(field+".tool_calls", "wrong type", "want a list of objects, found %s", typeName(x))
				}
				for j, cv := range calls {
					if !isObject(cv) {
						return nil, badf(fmt.Sprintf("%s.tool_calls[%d]", field, j), "wrong type", "want an object, found %s", typeName(cv))
					}
				}
				msg.ToolCalls = calls
			default:
				if msg.Extra == nil {
					msg.Extra = map[string]any{}
				}
				msg.Extra[k] = x
			}
		}
		if role == "assistant" {
			assistant = true
			if strings.TrimSpace(content) == "" && len(msg.ToolCalls) == 0 && msg.ReasoningContent == "" {
				return nil, badf(field, "empty assistant turn", "assistant message has no content and no tool calls")
			}
		}
		r.messages[i] = msg
	}
	if !assistant {
		return nil, badf(c.Messages, "no assistant turn",
			"the conversation has no assistant message, so completion-only loss has no targets")
	}
	return r, nil
}

// asMap returns an object as map[string]any; ordered objects (*chattmpl.Dict,
// used when key order matters to tojson) are flattened one level, keeping
// their nested values ordered.
func asMap(v any) (map[string]any, bool) {
	switch t := v.(type) {
	case map[string]any:
		return t, true
	case *chattmpl.Dict:
		m := make(map[string]any, t.Len())
		for _, k := range t.Keys() {
			ks, ok := k.(string)
			if !ok {
				return nil, false
			}
			m[ks], _ = t.Get(k)
		}
		return m, true
	}
	return nil, false
}

func isObject(v any) bool {
	switch v.(type) {
	case map[string]any, *chattmpl.Dict:
		return true
	}
	return false
}

func prefixField(err error, field string) error {
	if re, ok := err.(*RecordError); ok {
		if re.Field == "" {
			re.Field = field
		} else {
			re.Field = field + "." + re.Field
		}
	}
	return err
}

// pretokHint opens the errors about a pre-tokenized dataset's records. It
// names both the config key (trainer) and the flag (cachectl fill) that
// mark a dataset pre-tokenized: this package does not know which one the
// user set.
const pretokHint = "a pre-tokenized dataset (data.dataset.pretokenized: true, cachectl fill --pretokenized) needs input_ids in every record"

// parsePretokenized is parseRecord for a pre-tokenized dataset: the record
// must have input_ids; its text fields (messages, prompt, response, text),
// if any, are not read.
func parsePretokenized(obj map[string]any, c ColumnMap) (*record, error) {
	var text []string
	for _, k := range []string{c.Messages, c.Prompt, c.Response, c.Text} {
		if obj[k] != nil {
			text = append(text, strconv.Quote(k))
		}
	}
	fields := strings.Join(text, ", ")
	switch {
	case obj[c.InputIDs] == nil && len(text) > 0:
		return nil, badf("", "no input_ids",
			"%s, and this one has none, only text (%s): set pretokenized: false (or leave out --pretokenized) and give a tokenizer to tokenize text records, or give the record its input_ids",
			pretokHint, fields)
	case obj[c.InputIDs] == nil:
		return nil, badf("", "no input_ids", "%s (its non-null keys: %s); rename the ids field or set the source's column mapping (columns.input_ids)",
			pretokHint, nonNullKeys(obj))
	}
	return parseTokens(obj, c)
}

// nonNullKeys lists obj's keys with a value, sorted, for messages.
func nonNullKeys(obj map[string]any) string {
	keys := make([]string, 0, len(obj))
	for k, v := range obj {
		if v != nil {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	return strings.Join(keys, ", ")
}

func parseTokens(obj map[string]any, c ColumnMap) (*record, error) {
	ids, err := intList(obj[c.InputIDs], c.InputIDs, math.MinInt32, math.MaxInt32)
	if err != nil {
		return nil, err
	}
	if len(ids) == 0 {
		return nil, badf(c.InputIDs, "empty input_ids", "the id list is empty")
	}
	r := &record{kind: kindTokens, ids: make([]int32, len(ids))}
	for i, v := range ids {
		r.ids[i] = int32(v)
	}
	if mv := obj[c.LossMask]; mv != nil {
		m, err := intList(mv, c.LossMask, 0, 1)
		if err != nil {
			return nil, err
		}
		if len(m) != len(ids) {
			return nil, badf(c.LossMask, "length mismatch", "%d mask values for %d ids; give one 0/1 per id", len(m), len(ids))
		}
		r.mask = make([]uint8, len(m))
		any1 := false
		for i, v := range m {
			r.mask[i] = uint8(v)
			any1 = any1 || v == 1
		}
		if !any1 {
			return nil, badf(c.LossMask, "no targets", "every mask value is 0, so the sample has nothing to train on")
		}
	}
	return r, nil
}

// intList reads a JSON/Parquet list of integers in [lo, hi]. Booleans are
// accepted as 0/1 (some datasets store loss masks as bools).
func intList(v any, field string, lo, hi int64) ([]int64, error) {
	list, ok := v.([]any)
	if !ok {
		return nil, badf(field, "wrong type", "want a list of integers, found %s", typeName(v))
	}
	out := make([]int64, len(list))
	for i, x := range list {
		var n int64
		switch t := x.(type) {
		case json.Number:
			var err error
			if n, err = t.Int64(); err != nil {
				return nil, badf(fmt.Sprintf("%s[%d]", field, i), "wrong type", "want an integer, found %s", t.String())
			}
		case int64:
			n = t
		case float64:
			if t != math.Trunc(t) || math.Abs(t) > 1<<53 {
				return nil, badf(fmt.Sprintf("%s[%d]", field, i), "wrong type", "want an integer, found %v", t)
			}
			n = int64(t)
		case bool:
			if t {
				n = 1
			}
		default:
			return nil, badf(fmt.Sprintf("%s[%d]", field, i), "wrong type", "want an integer, found %s", typeName(x))
		}
		if n < lo || n > hi {
			return nil, badf(fmt.Sprintf("%s[%d]", field, i), "out of range", "value %d is outside [%d, %d]", n, lo, hi)
		}
		out[i] = n
	}
	return out, nil
}

func typeName(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case string:
		return "a string"
	case json.Number, int64, float64:
		return "a number"
	case bool:
		return "a boolean"
	case []any:
		return "a list"
	case map[string]any, *chattmpl.Dict:
		return "an object"
	}
	return fmt.Sprintf("%T", v)
}
