package data

import (
	"fmt"
	"strings"
)

// fakeTok is a byte-level tokenizer with a few special tokens: every byte is
// one token (id = byte value) and each special token is one id from 256 on.
// Offsets are therefore trivially right, which makes mask checks exact.
type fakeTok struct {
	specials []string
	bos, eos string
	addBOS   bool
	template string
	fp       string
}

func newFakeTok() *fakeTok {
	return &fakeTok{
		specials: []string{"<s>", "</s>", "<|im_start|>", "<|im_end|>"},
		eos:      "</s>",
		fp:       "fake-v1",
	}
}

func (t *fakeTok) EncodeOffsets(s string) ([]int32, [][2]int) {
	var ids []int32
	var offs [][2]int
	for i := 0; i < len(s); {
		matched := false
		for k, sp := range t.specials {
			if s[i] != '<' {
				break
			}
			if strings.HasPrefix(s[i:], sp) {
				ids = append(ids, int32(256+k))
				offs = append(offs, [2]int{i, i + len(sp)})
				i += len(sp)
				matched = true
				break
			}
		}
		if !matched {
			ids = append(ids, int32(s[i]))
			offs = append(offs, [2]int{i, i + 1})
			i++
		}
	}
	return ids, offs
}

func (t *fakeTok) Encode(s string) []int32 { ids, _ := t.EncodeOffsets(s); return ids }
func (t *fakeTok) VocabSize() int          { return 256 + len(t.specials) }
func (t *fakeTok) TokenID(s string) (int32, bool) {
	for k, sp := range t.specials {
		if sp == s {
			return int32(256 + k), true
		}
	}
	if len(s) == 1 {
		return int32(s[0]), true
	}
	return 0, false
}
func (t *fakeTok) Fingerprint() string  { return t.fp }
func (t *fakeTok) ChatTemplate() string { return t.template }
func (t *fakeTok) BOS() string          { return t.bos }
func (t *fakeTok) EOS() string          { return t.eos }
func (t *fakeTok) AddBOS() bool         { return t.addBOS }

// decode inverts EncodeOffsets.
func (t *fakeTok) decode(ids []int32) string {
	var b strings.Builder
	for _, id := range ids {
		if id >= 256 {
			b.WriteString(t.specials[id-256])
		} else {
			b.WriteByte(byte(id))
		}
	}
	return b.String()
}

// chatML renders ChatML like Qwen2.5's template without tools: each turn is
// "<|im_start|>role\ncontent<|im_end|>\n".
type chatML struct{}

func (chatML) Render(msgs []Message, gen bool, vars map[string]any) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		fmt.Fprintf(&b, "<|im_start|>%s\n%s<|im_end|>\n", m.Role, m.Content)
	}
	if gen {
		b.WriteString("<|im_start|>assistant\n")
	}
	return b.String(), nil
}

// lastTurnThinks mimics Qwen3: the last assistant turn gets an (empty) think
// block, earlier ones do not, so rendering messages[:i+1] is not a prefix of
// the whole conversation.
type lastTurnThinks struct{}

func (lastTurnThinks) Render(msgs []Message, gen bool, vars map[string]any) (string, error) {
	var b strings.Builder
	for i, m := range msgs {
		if m.Role == "assistant" && i == len(msgs)-1 {
			fmt.Fprintf(&b, "<|im_start|>assistant\n<think>\n\n</think>\n\n%s<|im_end|>\n", m.Content)
			continue
		}
		fmt.Fprintf(&b, "<|im_start|>%s\n%s<|im_end|>\n", m.Role, m.Content)
	}
	if gen {
		b.WriteString("<|im_start|>assistant\n")
	}
	return b.String(), nil
}

// countsTurns breaks the prefix property: every turn header carries the
// total number of messages, so earlier turns change as the chat grows.
type countsTurns struct{}

func (countsTurns) Render(msgs []Message, gen bool, vars map[string]any) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		fmt.Fprintf(&b, "[%d]%s: %s\n", len(msgs), m.Role, m.Content)
	}
	if gen {
		b.WriteString("assistant: ")
	}
	return b.String(), nil
}
