package trainer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"distill/data/tokenizer"
	"distill/model"
	"distill/train"

	"gopkg.in/yaml.v3"
)

// tokenizerFiles are the files of an HF tokenizer that an exported model
// ships beside its weights (those present are copied, all from one
// directory); generation_config.json comes from the model the student
// started from.
var tokenizerFiles = []string{"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
	"vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja"}

// ExportOptions control Export.
type ExportOptions struct {
	// Format: "bf16" (HF BF16), "f32" (the exact master weights) or
	// "nvfp4" (Model-Optimizer NVFP4; needs a quant: nvfp4 run); a LoRA
	// run's bf16 and f32 are the merged model (W + (alpha/r)·B·A), and
	// "peft" writes its adapters alone as PEFT saves them
	// (adapter_config.json, adapter_model.safetensors).
	Format string
	// Force replaces a non-empty output directory.
	Force bool
	// NoTokenizer exports the weights alone, without the tokenizer files.
	NoTokenizer bool
}

// ExportReport says what Export wrote.
type ExportReport struct {
	Files []string // the output directory's files
	// TokenizerFrom is the directory the tokenizer files were copied
	// from; "" with Note saying why none were.
	TokenizerFrom string
	Note          string
	// ChatTemplate says where the exported chat template came from when
	// the run overrode the tokenizer's ("" otherwise).
	ChatTemplate string
	// GenerationConfig says where generation_config.json came from (the
	// directory it was copied from, or written from config.json and the
	// tokenizer's EOS when no source had one), or why there is none.
	GenerationConfig string
}

// CheckExportFormat refuses a format Export does not write ("" is bf16),
// before any checkpoint is read (`student export` reports it as a usage
// error).
func CheckExportFormat(format string) error {
	switch format {
	case "", "bf16", "f32", "nvfp4", "peft":
		return nil
	}
	return fmt.Errorf("--format %q: want bf16, f32, nvfp4 or peft (a LoRA run's adapters)", format)
}

// Export writes the student at src (a run directory, a checkpoint or an
// HF checkpoint directory) to out as a complete HF model directory: the
// weights and config.json, the tokenizer files of the run (its
// model.tokenizer or model.init_from directory, recorded in the
// checkpoint; a plain HF source's own) and generation_config.json. out is
// written through model.WriteDir: a temporary directory renamed into
// place, so it never mixes old and new files, and a non-empty out is
// refused unless o.Force. A tokenizer directory that no longer holds the
// tokenizer the run was checked against is an error (o.NoTokenizer skips
// the tokenizer).
func Export(src, out string, o ExportOptions) (*ExportReport, error) {
	if o.Format == "" {
		o.Format = "bf16"
	}
	if err := CheckExportFormat(o.Format); err != nil {
		return nil, err
	}
	// Before CheckOut, whose "give --force to replace it" is the wrong
	// advice here: --force removed the run being exported.
	if err := checkOutNotSource(src, out, o.Format); err != nil {
		return nil, err
	}
	if err := checkOutNotInput(src, out, o.Format); err != nil {
		return nil, err
	}
	// --out is checked before the model is loaded and written: a mount
	// point (which cannot be replaced) failed only after the whole model
	// was written beside it.
	if err := model.CheckOut(out, o.Force); err != nil {
		return nil, fmt.Errorf("--out: %w", err)
	}
	dt := map[string]string{"bf16": "BF16", "f32": "F32"}
	if ck, ok := shardedSource(src); ok && o.Format != "peft" {
		return exportSharded(src, ck, out, o)
	}
	s, st, err := LoadStudent(src)
	if err != nil {
		return nil, err
	}
	defer s.Free()
	switch {
	case o.Format == "peft" && s.LoRA() == nil:
		return nil, fmt.Errorf("--format peft: %s is a full fine-tune, not a LoRA run (model.lora): export bf16, f32 or nvfp4", src)
	case o.Format == "peft":
		return exportPEFT(s, st, out, o)
	case o.Format == "nvfp4" && s.LoRA() != nil && s.InputAmax() == nil:
		return nil, fmt.Errorf("--format nvfp4: %s is a LoRA run whose checkpoint holds no input amax (state.json's lora.input_amax: made before LoRA runs calibrated them, with calib_batches 0, or sizes NVFP4 cannot take), and the merged model's NVFP4 export needs them: resume the run with this version for one more step (raise train.max_steps by 1; it calibrates them on calib_batches rows before that step) and export its new checkpoint, or export the merged model as bf16 or f32, or the adapters as peft", src)
	}
	if o.Format == "nvfp4" && !s.QAD && s.LoRA() == nil {
		return nil, fmt.Errorf("--format nvfp4: %s was not trained with quant: nvfp4 (no calibrated amax); train with QAD or export bf16", src)
	}
	return writeExport(src, out, st, o, s.Cfg, func(tmp string) error {
		if o.Format == "nvfp4" {
			return s.WriteNVFP4(tmp)
		}
		return s.WriteHF(tmp, dt[o.Format])
	})
}

// checkOutNotSource refuses an out that is src or a directory holding it
// (`--checkpoint run --out run --force`, or `--checkpoint
// run/checkpoints/step-N --out run --force`): the export replaces out
// whole, so the run's checkpoints, metrics and config were removed and
// the export put in their place, and the command reported success.
func checkOutNotSource(src, out, format string) error {
	s, err := realPath(src)
	if err != nil {
		return nil // src is refused, naming it, when it is loaded
	}
	o, err := realPath(out)
	if err != nil {
		return nil // out does not exist yet: it holds nothing
	}
	rel, ok := within(o, s)
	if !ok {
		return nil
	}
	what := "is the directory being exported"
	if rel != "." {
		what = "holds the checkpoint being exported (" + src + ")"
	}
	alt := filepath.Clean(out)
	if alt == "." || alt == ".." || alt == string(filepath.Separator) {
		alt = o
	}
	return fmt.Errorf("--out %s %s, and the export replaces --out whole (--force would remove what it exports): choose a new directory, e.g. --out %s-%s",
		out, what, alt, format)
}

// checkOutNotInput refuses an out that is, or holds, a directory the run
// at src was made from: its base model (model.init_from: the weights a
// LoRA run's adapters apply to, the tokenizer and generation config an
// export copies) or its model.tokenizer directory. The export replaces
// out whole, so `--out <the base model> --force` replaced the user's HF
// checkpoint with the export, and the run could no longer resume or
// export again. A src whose state cannot be read is left to the load,
// which names what is wrong with it.
func checkOutNotInput(src, out, format string) error {
	o, err := realPath(out)
	if err != nil {
		return nil // out does not exist yet: it holds nothing
	}
	run, ck, err := runDirOf(src)
	if err != nil || ck == "" {
		return nil
	}
	if run == "" {
		run = ck
	}
	st, err := loadState(ck)
	if err != nil {
		return nil
	}
	for _, in := range []struct{ dir, what string }{
		{st.InitFrom, "the run's base model (model.init_from), which its checkpoints need"},
		{st.TokenizerDir, "the run's tokenizer directory (model.tokenizer)"},
	} {
		if in.dir == "" {
			continue
		}
		d, err := realPath(in.dir)
		if err != nil {
			continue
		}
		rel, ok := within(o, d)
		if !ok {
			continue
		}
		holds := "is"
		if rel != "." {
			holds = "holds " + in.dir + ","
		}
		return fmt.Errorf("--out %s %s %s, and the export replaces --out whole (--force would remove it): choose a new directory, e.g. --out %s-%s",
			out, holds, in.what, filepath.Clean(run), format)
	}
	return nil
}

// within reports whether p is dir or below it (both real paths), and p
// relative to dir ("." for dir itself).
func within(dir, p string) (rel string, ok bool) {
	rel, err := filepath.Rel(dir, p)
	if err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return "", false
	}
	return rel, true
}

// realPath is path absolute, its symbolic links resolved (an error when
// it does not exist).
func realPath(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	return filepath.EvalSymlinks(abs)
}

// shardedSource is the sharded checkpoint src names (a run directory
// whose newest checkpoint is sharded, or a sharded checkpoint).
func shardedSource(src string) (string, bool) {
	_, ck, err := runDirOf(src)
	if err != nil || ck == "" || !isSharded(ck) {
		return "", false
	}
	return ck, true
}

// exportSharded is Export of the sharded checkpoint ck (src as the user
// named it) in BF16, F32 or NVFP4: the HF model.safetensors is written
// tensor by tensor from the shards' pieces, so the export holds one
// tensor in host memory, never the model.
func exportSharded(src, ck, out string, o ExportOptions) (*ExportReport, error) {
	st, err := loadState(ck)
	if err != nil {
		return nil, err
	}
	if o.Format == "nvfp4" && st.QuantAmax == nil {
		return nil, fmt.Errorf("--format nvfp4: %s was not trained with quant: nvfp4 (no calibrated amax); train with QAD or export bf16", src)
	}
	cfg, err := model.LoadConfig(ck)
	if err != nil {
		return nil, err
	}
	c, err := openSharded(ck)
	if err != nil {
		return nil, err
	}
	defer c.close()
	return writeExport(src, out, st, o, cfg, func(tmp string) error {
		read := func(name string, dst []float32) error { return c.read(name, len(dst), 0, dst) }
		if o.Format == "nvfp4" {
			return train.WriteNVFP4From(tmp, cfg, st.QuantAmax, read)
		}
		return model.WriteCheckpointFrom(tmp, cfg, map[string]string{"bf16": "BF16", "f32": "F32"}[o.Format], read)
	})
}

// writeExport writes out through model.WriteDir: the weights (weights),
// the run's tokenizer files (src's run, as st records it) and
// generation_config.json, and reports what it wrote.
func writeExport(src, out string, st *State, o ExportOptions, cfg *model.Config, weights func(tmp string) error) (*ExportReport, error) {
	rep := &ExportReport{}
	// tmpl is the chat template the run rendered its samples with when
	// it overrode the tokenizer's (data.dataset.chat_template).
	tmpl, err := runChatTemplate(src, st)
	if err != nil {
		return nil, err
	}
	if tmpl != "" && !o.NoTokenizer {
		rep.ChatTemplate = "the run's data.dataset.chat_template"
	}
	et, err := exportTokenizer(src, out, st, o, rep)
	if err != nil {
		return nil, err
	}
	err = model.WriteDir(out, o.Force, func(tmp string) error {
		if err := weights(tmp); err != nil {
			return err
		}
		if err := et.copyFiles(tmp, tmpl, o, rep); err != nil {
			return err
		}
		if err := et.generationConfig(tmp, cfg, o, rep); err != nil {
			return err
		}
		ents, err := os.ReadDir(tmp)
		if err != nil {
			return err
		}
		for _, e := range ents {
			rep.Files = append(rep.Files, e.Name())
		}
		sort.Strings(rep.Files)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return rep, nil
}

// exportPEFT writes a LoRA run's adapters to out as PEFT saves them:
// adapter_config.json (base_model_name_or_path: the run's base) and
// adapter_model.safetensors (fp32), no tokenizer (the base's serves).
func exportPEFT(s *train.Student, st *State, out string, o ExportOptions) (*ExportReport, error) {
	rep := &ExportReport{Note: "adapters only (PEFT): load them onto the base named in adapter_config.json; no tokenizer files copied"}
	err := model.WriteDir(out, o.Force, func(tmp string) error {
		if err := s.WritePEFT(tmp, peftBase(st)); err != nil {
			return err
		}
		rep.Files = []string{train.PEFTConfigFile, train.PEFTWeightsFile}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return rep, nil
}

// exportTok is where an export's tokenizer files and generation config
// come from.
type exportTok struct {
	dir     string               // the tokenizer files' directory ("": none to copy)
	genDirs []string             // generation_config.json from the first that has one
	tk      *tokenizer.Tokenizer // the run's tokenizer, when its directory is known
}

// exportTokenizer finds the tokenizer of the student at src (st: its
// run's state; nil for a plain HF directory), checking that a run's
// tokenizer directory still holds the tokenizer it trained with.
func exportTokenizer(src, out string, st *State, o ExportOptions, rep *ExportReport) (*exportTok, error) {
	et := &exportTok{}
	switch {
	case o.NoTokenizer:
		rep.Note = "tokenizer files not copied (--no-tokenizer)"
	case st == nil:
		// A plain HF directory: its own tokenizer and generation config.
		et.dir, et.genDirs = src, []string{src}
		if _, err := os.Stat(filepath.Join(src, "tokenizer.json")); err != nil {
			et.dir, rep.Note = "", fmt.Sprintf("%s has no tokenizer.json: no tokenizer files copied", src)
		}
	case st.TokenizerDir == "":
		et.genDirs = []string{st.InitFrom}
		rep.Note = fmt.Sprintf("the run knows only its tokenizer's fingerprint %s (no model.tokenizer directory): copy tokenizer.json and tokenizer_config.json into %s yourself", st.TokenizerFingerprint, out)
	default:
		et.dir, et.genDirs = st.TokenizerDir, []string{st.InitFrom, st.TokenizerDir}
		tk, err := tokenizer.Load(et.dir)
		et.tk = tk
		if err != nil {
			return nil, fmt.Errorf("the run's tokenizer directory %s: %w: restore it, or give --no-tokenizer to export the weights alone", et.dir, err)
		}
		if tk.Fingerprint() != st.TokenizerFingerprint {
			return nil, fmt.Errorf("the run's tokenizer directory %s now holds tokenizer %s, but the run was trained with %s: restore it, or give --no-tokenizer to export the weights alone",
				et.dir, tk.Fingerprint(), st.TokenizerFingerprint)
		}
	}
	return et, nil
}

// copyFiles copies the tokenizer files into tmp, with the run's chat
// template (tmpl) where it overrode the tokenizer's.
func (et *exportTok) copyFiles(tmp, tmpl string, o ExportOptions, rep *ExportReport) error {
	if et.dir == "" {
		if tmpl != "" && !o.NoTokenizer {
			// No tokenizer files to carry it: the template alone, which
			// transformers reads beside the tokenizer files copied later.
			return os.WriteFile(filepath.Join(tmp, "chat_template.jinja"), []byte(tmpl), 0o644)
		}
		return nil
	}
	n := 0
	for _, f := range tokenizerFiles {
		ok, err := copyIfExists(filepath.Join(et.dir, f), filepath.Join(tmp, f))
		if err != nil {
			return err
		}
		if ok {
			n++
		}
	}
	if n > 0 {
		rep.TokenizerFrom = et.dir
	}
	return carryChatTemplate(tmp, tmpl)
}

// generationConfig copies generation_config.json from the first of the
// source directories that has one, or writes HF's from_model_config
// (config.json's BOS and EOS, the tokenizer's EOS where config.json has
// none) for a random-init student.
func (et *exportTok) generationConfig(tmp string, mc *model.Config, o ExportOptions, rep *ExportReport) error {
	for _, d := range et.genDirs {
		if d == "" {
			continue
		}
		ok, err := copyIfExists(filepath.Join(d, "generation_config.json"), filepath.Join(tmp, "generation_config.json"))
		if err != nil {
			return err
		}
		if ok {
			rep.GenerationConfig = "copied from " + d
			return nil
		}
	}
	if o.NoTokenizer {
		rep.GenerationConfig = "not written (--no-tokenizer)"
		return nil
	}
	g := map[string]any{"_from_model_config": true}
	if mc.BOSTokenID >= 0 {
		g["bos_token_id"] = mc.BOSTokenID
	}
	eos := mc.EOSTokenID
	if eos < 0 && et.tk != nil {
		if id, ok := et.tk.TokenID(et.tk.EOS()); ok {
			eos = int(id)
		}
	}
	if eos < 0 {
		rep.GenerationConfig = "not written: no source had one, and neither config.json nor a tokenizer names an EOS token"
		return nil
	}
	g["eos_token_id"] = eos
	b, err := json.MarshalIndent(g, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(tmp, "generation_config.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	rep.GenerationConfig = "written from config.json and the tokenizer (no source had one)"
	return nil
}

// copyIfExists copies src to dst; a missing src is not an error (false).
func copyIfExists(src, dst string) (bool, error) {
	in, err := os.Open(src)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return false, err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return false, fmt.Errorf("copying %s: %w", src, err)
	}
	return true, out.Close()
}

// runChatTemplate is the chat template the run of the checkpoint st
// (loaded from src) rendered its samples with when it overrode the
// tokenizer's (data.dataset.chat_template): recorded in state.json, or,
// for checkpoints written before that, read from the file the run's
// config.yaml names. "" when the run used the tokenizer's own.
func runChatTemplate(src string, st *State) (string, error) {
	if st == nil {
		return "", nil // a plain HF directory: its own tokenizer files
	}
	if st.ChatTemplate != "" {
		return st.ChatTemplate, nil
	}
	runDir, _, err := runDirOf(src)
	if err != nil || runDir == "" {
		return "", err
	}
	p := filepath.Join(runDir, "config.yaml")
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	var c struct {
		Data struct {
			Dataset *struct {
				ChatTemplate string `yaml:"chat_template"`
			} `yaml:"dataset"`
		} `yaml:"data"`
	}
	if err := yaml.Unmarshal(b, &c); err != nil || c.Data.Dataset == nil || c.Data.Dataset.ChatTemplate == "" {
		return "", nil // not a dataset run with its own template
	}
	f := c.Data.Dataset.ChatTemplate
	t, err := os.ReadFile(f)
	if err != nil {
		return "", fmt.Errorf("the run %s was trained with data.dataset.chat_template %s, which cannot be read now (%v): the export must carry the template the model was trained with; restore the file, or give --no-tokenizer to export the weights alone", runDir, f, err)
	}
	return string(t), nil
}

// carryChatTemplate makes the tokenizer files copied into dir carry the
// chat template tmpl ("": the tokenizer's own, left as copied): as
// transformers saves a tokenizer, tokenizer_config.json's chat_template
// holds it (created when the tokenizer had none; its other keys are kept
// in order), and a chat_template.jinja, which newer transformers read in
// its place, holds the same. With tmpl "", a template that only a
// chat_template.jinja holds is written into tokenizer_config.json too, so
// that older readers of the export chat alike.
func carryChatTemplate(dir, tmpl string) error {
	tk, err := tokenizer.Load(dir)
	if err != nil {
		return err
	}
	if tmpl == "" {
		tmpl = tk.ChatTemplate()
	}
	if tmpl == "" {
		return nil
	}
	jinja := filepath.Join(dir, "chat_template.jinja")
	if b, err := os.ReadFile(jinja); err == nil && string(b) != tmpl {
		if err := os.WriteFile(jinja, []byte(tmpl), 0o644); err != nil {
			return err
		}
	}
	path := filepath.Join(dir, "tokenizer_config.json")
	keys, vals, err := readJSONObject(path)
	if err != nil {
		return err
	}
	i := keyIndex(keys, "chat_template")
	var cur string
	if i >= 0 && json.Unmarshal(vals[i], &cur) == nil && cur == tmpl {
		return checkChatTemplate(dir, tmpl)
	}
	v, err := templateValue(tmpl, vals, i)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if i < 0 {
		keys, vals = append(keys, "chat_template"), append(vals, v)
	} else {
		vals[i] = v
	}
	if err := writeJSONObject(path, keys, vals); err != nil {
		return err
	}
	return checkChatTemplate(dir, tmpl)
}

// keyIndex is the index of k in keys, -1 if absent.
func keyIndex(keys []string, k string) int {
	for i, x := range keys {
		if x == k {
			return i
		}
	}
	return -1
}

// templateValue is the chat_template value holding tmpl: a string, or,
// when the config has a list of named templates (vals[i]), that list with
// its "default" entry set to tmpl.
func templateValue(tmpl string, vals []json.RawMessage, i int) (json.RawMessage, error) {
	if i >= 0 {
		var named []map[string]any
		if json.Unmarshal(vals[i], &named) == nil {
			found := false
			for _, n := range named {
				if n["name"] == "default" {
					n["template"], found = tmpl, true
				}
			}
			if !found {
				named = append(named, map[string]any{"name": "default", "template": tmpl})
			}
			return marshalNoEscape(named)
		}
	}
	return marshalNoEscape(tmpl)
}

// marshalNoEscape is json.Marshal without escaping <, > and & (Jinja
// templates are full of them; Python's json.dumps leaves them).
func marshalNoEscape(v any) (json.RawMessage, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimRight(b.Bytes(), "\n"), nil
}

// readJSONObject reads the top-level keys of the JSON object at path in
// their order, with their values as they are (a missing file: none).
func readJSONObject(path string) ([]string, []json.RawMessage, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil, nil, fmt.Errorf("%s: not a JSON object", path)
	}
	var keys []string
	var vals []json.RawMessage
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", path, err)
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, nil, fmt.Errorf("%s: %w", path, err)
		}
		keys, vals = append(keys, t.(string)), append(vals, v)
	}
	return keys, vals, nil
}

// writeJSONObject writes keys and vals as one JSON object, indented by
// two spaces as transformers writes tokenizer_config.json.
func writeJSONObject(path string, keys []string, vals []json.RawMessage) error {
	var b bytes.Buffer
	b.WriteString("{")
	for i, k := range keys {
		if i > 0 {
			b.WriteString(",")
		}
		kb, _ := marshalNoEscape(k)
		b.WriteString("\n  ")
		b.Write(kb)
		b.WriteString(": ")
		if err := json.Indent(&b, vals[i], "  ", "  "); err != nil {
			return fmt.Errorf("%s: %s: %w", path, k, err)
		}
	}
	b.WriteString("\n}\n")
	return os.WriteFile(path, b.Bytes(), 0o644)
}

// checkChatTemplate checks that the tokenizer in dir now reads tmpl as its
// chat template.
func checkChatTemplate(dir, tmpl string) error {
	tk, err := tokenizer.Load(dir)
	if err != nil {
		return err
	}
	if tk.ChatTemplate() != tmpl {
		return fmt.Errorf("the exported tokenizer in %s does not read back the run's chat template (%d bytes, want %d): a bug; give --no-tokenizer and copy the tokenizer files yourself", dir, len(tk.ChatTemplate()), len(tmpl))
	}
	return nil
}
