package data

import (
	"fmt"
	"strings"
	"unicode"

	"distill/internal/errkind"
)

// Tokenizer is what this package needs from a tokenizer;
// *tokenizer.Tokenizer (distill/data/tokenizer) implements it. Encode must
// not add BOS/EOS by itself: this package adds them as AddBOS/NoEOS say.
// Special tokens written in the text (<|im_start|>) must be recognized.
type Tokenizer interface {
	Encode(text string) []int32
	// EncodeOffsets also returns each token's byte span [start, end) in text.
	EncodeOffsets(text string) (ids []int32, offsets [][2]int)
	VocabSize() int
	TokenID(tok string) (int32, bool)
	Fingerprint() string
	ChatTemplate() string
	BOS() string
	EOS() string
	AddBOS() bool
}

// Renderer renders a conversation with a chat template. vars are extra
// template variables (tools, enable_thinking, ...).
type Renderer interface {
	Render(msgs []Message, addGenerationPrompt bool, vars map[string]any) (string, error)
}

// encoder turns records into token ids and loss masks. It is immutable after
// newEncoder and shared by the tokenization workers.
type encoder struct {
	tok       Tokenizer
	tmpl      Renderer // nil when the tokenizer has no chat template
	vars      map[string]any
	vocab     int
	bos, eos  string
	bosID     int32
	eosID     int32
	addBOS    bool // tokenizer wants BOS and has one
	appendEOS bool // text and template-less prompt/response end with EOS
	// marker is the text a template writes right after an assistant turn's
	// content to end the turn (<|im_end|>, <|eot_id|>); "" when none was
	// found. It is part of the assistant span: the model must learn to stop.
	marker    string
	markerErr error
	// pretok: the tokenizer is IDsOnly, so the dataset is pre-tokenized:
	// every record must be input_ids (parsePretokenized), checked against
	// the vocabulary of the model the ids are for, not a tokenizer's.
	pretok bool
}

func newEncoder(tok Tokenizer, tmpl Renderer, vars map[string]any, noEOS bool) (*encoder, error) {
	e := &encoder{tok: tok, tmpl: tmpl, vars: vars, vocab: tok.VocabSize(), bos: tok.BOS(), eos: tok.EOS()}
	switch tok.(type) {
	case IDsOnly, *IDsOnly:
		e.pretok = true
	}
	if e.bos != "" {
		id, ok := tok.TokenID(e.bos)
		if !ok {
			return nil, errkind.Errorf(ErrOptions, "tokenizer's BOS token %q is not in its vocabulary", e.bos)
		}
		e.bosID = id
		e.addBOS = tok.AddBOS()
	}
	if e.eos != "" {
		id, ok := tok.TokenID(e.eos)
		if !ok {
			return nil, errkind.Errorf(ErrOptions, "tokenizer's EOS token %q is not in its vocabulary", e.eos)
		}
		e.eosID = id
		e.appendEOS = !noEOS
	}
	if tmpl != nil {
		e.marker, e.markerErr = e.probeMarker()
	}
	return e, nil
}

// probeMarker finds the end-of-turn marker by rendering a probe answer once
// as the last turn and once followed by a user turn: the text both renderings
// put right after the answer ends the turn; its first non-blank token is the
// marker. For ChatML that is "<|im_end|>" (not the "\n" after it, which the
// model never generates); for Llama 3 "<|eot_id|>".
func (e *encoder) probeMarker() (string, error) {
	const answer = "Probe answer 7f3a"
	u := Message{Role: "user", Content: "Probe question"}
	a := Message{Role: "assistant", Content: answer}
	h1, err := e.tmpl.Render([]Message{u, a}, false, e.vars)
	if err != nil {
		return "", err
	}
	h2, err := e.tmpl.Render([]Message{u, a, {Role: "user", Content: "Next question"}}, false, e.vars)
	if err != nil {
		return "", err
	}
	i1, i2 := strings.Index(h1, answer), strings.Index(h2, answer)
	if i1 < 0 || i2 < 0 {
		return "", fmt.Errorf("the template does not write the assistant content verbatim")
	}
	common := h1[i1+len(answer):]
	common = common[:commonPrefix(common, h2[i2+len(answer):])]
	_, offs := e.tok.EncodeOffsets(common)
	for _, o := range offs {
		if t := common[o[0]:o[1]]; strings.TrimSpace(t) != "" {
			return common[:o[1]], nil
		}
	}
	return "", nil
}

func commonPrefix(a, b string) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// encode tokenizes one record into ids and a loss mask (mask[t] = 1: token t
// is a target). It does not apply MaxLen.
func (e *encoder) encode(r *record) ([]int32, []uint8, error) {
	switch r.kind {
	case kindTokens:
		for i, id := range r.ids {
			if id < 0 || int(id) >= e.vocab {
				if e.pretok {
					return nil, nil, badf(fmt.Sprintf("input_ids[%d]", i), "id out of vocab",
						"token id %d is outside [0, %d): the model the ids are read for has vocab_size %d; were they made by a tokenizer of a larger vocabulary?", id, e.vocab, e.vocab)
				}
				return nil, nil, badf(fmt.Sprintf("input_ids[%d]", i), "id out of vocab",
					"token id %d is outside [0, %d) of this tokenizer; was the data tokenized with another tokenizer?", id, e.vocab)
			}
		}
		mask := r.mask
		if mask == nil {
			mask = make([]uint8, len(r.ids))
			for i := range mask {
				mask[i] = 1
			}
		}
		return r.ids, mask, nil
	case kindText:
		ids := e.tok.Encode(r.text)
		mask := ones(len(ids))
		ids, mask = e.withBOS(r.text, ids, mask)
		if e.appendEOS && !strings.HasSuffix(r.text, e.eos) {
			ids, mask = append(ids, e.eosID), append(mask, 1)
		}
		return ids, mask, nil
	case kindPromptResponse:
		if e.tmpl != nil {
			msgs := make([]Message, 0, 3)
			if r.system != "" {
				msgs = append(msgs, Message{Role: "system", Content: r.system})
			}
			msgs = append(msgs, Message{Role: "user", Content: r.prompt}, Message{Role: "assistant", Content: r.response})
			return e.encodeChat(msgs, nil)
		}
		// No template (a base model): the prompt (after the system text) and
		// the response are tokenized separately and concatenated, so the
		// prompt tokens are exactly those the model sees at inference.
		p := e.tok.Encode(r.system + r.prompt)
		ids, mask := e.withBOS(r.system+r.prompt, p, make([]uint8, len(p)))
		resp := e.tok.Encode(r.response)
		ids = append(ids, resp...)
		mask = append(mask, ones(len(resp))...)
		if e.appendEOS && !strings.HasSuffix(r.response, e.eos) {
			ids, mask = append(ids, e.eosID), append(mask, 1)
		}
		return ids, mask, nil
	case kindChat:
		return e.encodeChat(r.messages, r.tools)
	}
	return nil, nil, fmt.Errorf("data: internal error: record kind %d", r.kind)
}

func ones(n int) []uint8 {
	m := make([]uint8, n)
	for i := range m {
		m[i] = 1
	}
	return m
}

// withBOS prepends BOS (never a target: nothing predicts it) when the
// tokenizer asks for it and the text does not already start with it.
func (e *encoder) withBOS(text string, ids []int32, mask []uint8) ([]int32, []uint8) {
	if !e.addBOS || strings.HasPrefix(text, e.bos) {
		return ids, mask
	}
	return append([]int32{e.bosID}, ids...), append([]uint8{0}, mask...)
}

// encodeChat renders the conversation and marks the tokens of every
// assistant turn. Turn i spans from where the rendering of messages[:i] with
// the generation prompt ends, through the end-of-turn marker that follows the
// turn's content. Both ends are found in the full rendering, so the tokens
// are those of one tokenization of the whole conversation. Templates that
// mark assistant output with {% generation %} give the spans directly.
func (e *encoder) encodeChat(msgs []Message, tools any) ([]int32, []uint8, error) {
	if e.tmpl == nil {
		return nil, nil, tmplf("no chat template", "the tokenizer has no chat template; give one (--chat-template) or use prompt/response or text records")
	}
	vars := e.vars
	if tools != nil {
		vars = make(map[string]any, len(e.vars)+1)
		for k, v := range e.vars {
			vars[k] = v
		}
		vars["tools"] = tools
	}
	var (
		full  string
		spans [][2]int
		err   error
	)
	if sr, ok := e.tmpl.(spanRenderer); ok {
		full, spans, err = sr.RenderSpans(msgs, false, vars)
	} else {
		full, err = e.tmpl.Render(msgs, false, vars)
	}
	if err != nil {
		return nil, nil, tmplf("render failed", "%v", err)
	}
	if len(spans) == 0 {
		if spans, err = e.assistantSpans(msgs, full, vars); err != nil {
			return nil, nil, err
		}
	}
	ids, offs := e.tok.EncodeOffsets(full)
	mask := make([]uint8, len(ids))
	k := 0
	for t, o := range offs {
		for k < len(spans) && spans[k][1] <= o[0] {
			k++
		}
		// A token is a target if it overlaps an assistant span: a token that
		// straddles the boundary is something the model has to produce.
		if k < len(spans) && o[1] > spans[k][0] && o[0] < spans[k][1] {
			mask[t] = 1
		}
	}
	ids, mask = e.withBOS(full, ids, mask)
	return ids, mask, nil
}

// spanRenderer is a Renderer that can report the spans a template marks
// with {% generation %} itself; those are used as the assistant spans.
type spanRenderer interface {
	RenderSpans(msgs []Message, gen bool, vars map[string]any) (string, [][2]int, error)
}

// assistantSpans locates the assistant turns in the rendered conversation
// full, for templates without {% generation %} markers.
func (e *encoder) assistantSpans(msgs []Message, full string, vars map[string]any) ([][2]int, error) {
	var spans [][2]int
	prevEnd := 0
	for i, m := range msgs {
		if m.Role != "assistant" {
			continue
		}
		start, err := e.turnStart(msgs, i, full, vars)
		if err != nil {
			return nil, err
		}
		if start < prevEnd {
			return nil, tmplf("overlapping turns", "assistant message %d starts at byte %d, before the previous assistant turn ends (%d)", i, start, prevEnd)
		}
		end, err := e.turnEnd(full, start, m)
		if err != nil {
			return nil, prefixField(err, fmt.Sprintf("messages[%d]", i))
		}
		spans = append(spans, [2]int{start, end})
		prevEnd = end
	}
	return spans, nil
}

// turnStart finds where assistant message i begins in the full rendering.
func (e *encoder) turnStart(msgs []Message, i int, full string, vars map[string]any) (int, error) {
	pre, err := e.tmpl.Render(msgs[:i], true, vars)
	if err != nil {
		return 0, tmplf("render failed", "rendering messages[:%d] with add_generation_prompt: %v", i, err)
	}
	if strings.HasPrefix(full, pre) {
		return len(pre), nil
	}
	// Some generation prompts differ from how a finished turn is rendered
	// (Qwen3 with enable_thinking=false adds an empty think block to the
	// prompt but not to past turns). The turn then starts where the full
	// rendering departs from the generation prompt, provided the history
	// before it is unchanged.
	base, err := e.tmpl.Render(msgs[:i], false, vars)
	if err == nil && strings.HasPrefix(full, base) && strings.HasPrefix(pre, base) {
		return len(base) + commonPrefix(full[len(base):], pre[len(base):]), nil
	}
	d := commonPrefix(full, pre)
	return 0, tmplf("prefix property broken",
		"rendering messages[:%d] with add_generation_prompt=true is not a prefix of the rendered conversation (they differ at byte %d: %q vs %q), so the assistant turn cannot be located; fix the chat template or give pre-tokenized input_ids with a loss_mask",
		i, d, excerpt(pre, d), excerpt(full, d))
}

func excerpt(s string, at int) string {
	end := min(len(s), at+40)
	return s[at:end]
}

// turnEnd finds where the assistant turn starting at start ends: after the
// end-of-turn marker that follows its content.
func (e *encoder) turnEnd(full string, start int, m Message) (int, error) {
	from := start
	found := false
	if c := strings.TrimFunc(m.Content, unicode.IsSpace); c != "" {
		if p := strings.Index(full[start:], c); p >= 0 {
			from, found = start+p+len(c), true
		}
	}
	if e.marker != "" {
		if q := strings.Index(full[from:], e.marker); q >= 0 {
			return from + q + len(e.marker), nil
		}
	}
	if found {
		return from, nil
	}
	why := "the template writes no end-of-turn marker"
	if e.markerErr != nil {
		why = "probing the end-of-turn marker failed: " + e.markerErr.Error()
	}
	return 0, tmplf("turn end not found",
		"cannot find the end of the assistant turn starting at byte %d (its content does not appear verbatim and %s); use pre-tokenized input_ids with a loss_mask", start, why)
}
