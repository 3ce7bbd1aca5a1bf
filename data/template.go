package data

import (
	"distill/data/chattmpl"
)

// jinjaTemplate renders with distill/data/chattmpl, passing the tokenizer's
// special tokens as transformers' apply_chat_template does.
type jinjaTemplate struct {
	t        *chattmpl.Template
	bos, eos string
}

// compileTemplate compiles a Jinja chat template into a Renderer.
func compileTemplate(src, bos, eos string) (Renderer, error) {
	t, err := chattmpl.Compile(src)
	if err != nil {
		return nil, err
	}
	return &jinjaTemplate{t: t, bos: bos, eos: eos}, nil
}

func (j *jinjaTemplate) options(gen bool, vars map[string]any) chattmpl.Options {
	o := chattmpl.Options{AddGenerationPrompt: gen, BOSToken: j.bos, EOSToken: j.eos}
	if len(vars) > 0 {
		o.Extra = make(map[string]any, len(vars))
		for k, v := range vars {
			if k == "tools" {
				if list, ok := v.([]any); ok {
					o.Tools = list
					continue
				}
			}
			o.Extra[k] = v
		}
	}
	return o
}

func convertMessages(msgs []Message) []chattmpl.Message {
	out := make([]chattmpl.Message, len(msgs))
	for i, m := range msgs {
		out[i] = chattmpl.Message{Role: m.Role, Content: m.Content, ReasoningContent: m.ReasoningContent, Extra: m.Extra}
		if m.ToolCalls != nil {
			out[i].ToolCalls = m.ToolCalls
		}
	}
	return out
}

func (j *jinjaTemplate) Render(msgs []Message, gen bool, vars map[string]any) (string, error) {
	return j.t.Render(convertMessages(msgs), j.options(gen, vars))
}

// RenderSpans also returns the {% generation %} spans of templates that mark
// assistant output themselves (transformers' return_assistant_tokens_mask).
func (j *jinjaTemplate) RenderSpans(msgs []Message, gen bool, vars map[string]any) (string, [][2]int, error) {
	s, spans, err := j.t.RenderSpans(convertMessages(msgs), j.options(gen, vars))
	out := make([][2]int, len(spans))
	for i, sp := range spans {
		out[i] = [2]int{sp.Start, sp.End}
	}
	return s, out, err
}
