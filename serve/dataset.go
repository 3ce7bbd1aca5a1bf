package serve

import (
	"encoding/json"

	"distill/cache"
	"distill/data"
	"distill/internal/errkind"
	pb "distill/proto/distill/v1"
)

// DatasetSpec is the request form of the dataset that package data opens
// from srcs and opts: what `cachectl fill` sends, built from the same
// flags `cachectl tokenize` opens locally. pretokenized marks records that
// hold input_ids (no tokenizer). opts.Workers is each teacher's own and is
// not sent.
func DatasetSpec(srcs []data.Source, opts data.Options, pretokenized bool) (*pb.Dataset, error) {
	d := &pb.Dataset{Pretokenized: pretokenized, MaxLen: int32(opts.MaxLen), Policy: string(opts.Policy), SkipBad: opts.SkipBad,
		NumSamples: opts.NumSamples, Shuffle: opts.Shuffle, Seed: opts.Seed, NoEos: opts.NoEOS, ChatTemplate: opts.ChatTemplate}
	if int(d.MaxLen) != opts.MaxLen {
		return nil, errkind.Errorf(ErrInvalid, "max-len %d is too large", opts.MaxLen)
	}
	if len(opts.TemplateVars) > 0 {
		b, err := json.Marshal(opts.TemplateVars)
		if err != nil {
			return nil, errkind.Errorf(ErrInvalid, "template variables: %v", err)
		}
		d.TemplateVarsJson = string(b)
	}
	for _, s := range srcs {
		d.Sources = append(d.Sources, &pb.DataSource{Path: s.Path, Weight: s.Weight, Format: s.Format, Columns: columnsSpec(s.Columns)})
	}
	return d, nil
}

// columnsSpec is c as a request field; the default mapping is absent.
func columnsSpec(c data.ColumnMap) *pb.Columns {
	if c.Messages == "" && c.Prompt == "" && c.Response == "" && c.System == "" && c.Text == "" &&
		c.InputIDs == "" && c.LossMask == "" && c.Role == "" && c.Content == "" && len(c.Roles) == 0 {
		return nil
	}
	return &pb.Columns{Messages: c.Messages, Prompt: c.Prompt, Response: c.Response, System: c.System, Text: c.Text,
		InputIds: c.InputIDs, LossMask: c.LossMask, Role: c.Role, Content: c.Content, Roles: c.Roles}
}

// columnMap is the inverse of columnsSpec: the mapping a core reads a
// source with.
func columnMap(c *pb.Columns) data.ColumnMap {
	return data.ColumnMap{Messages: c.GetMessages(), Prompt: c.GetPrompt(), Response: c.GetResponse(), System: c.GetSystem(),
		Text: c.GetText(), InputIDs: c.GetInputIds(), LossMask: c.GetLossMask(), Role: c.GetRole(), Content: c.GetContent(), Roles: c.GetRoles()}
}

// chunkResponse reports a chunk Fill computed (or found done: skipped)
// with the counts of its samples.
func chunkResponse(rg cache.Range, st data.Stats, skipped bool) *pb.FillResponse {
	return &pb.FillResponse{Start: rg.Start, End: rg.End, Skipped: skipped, Tokens: st.Tokens, Targets: st.Targets,
		Truncated: st.Truncated, Dropped: st.Dropped, BadSkipped: st.Skipped, Reasons: st.Reasons, Examples: st.Examples}
}
