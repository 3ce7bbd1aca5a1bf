package trainer

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"

	"distill/data/tokenizer"
	"distill/model"
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
	// "nvfp4" (Model-Optimizer NVFP4; needs a quant: nvfp4 run).
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
	dt := map[string]string{"bf16": "BF16", "f32": "F32", "nvfp4": ""}
	if _, ok := dt[o.Format]; !ok {
		return nil, fmt.Errorf("--format %q: want bf16, f32 or nvfp4", o.Format)
	}
	s, st, err := LoadStudent(src)
	if err != nil {
		return nil, err
	}
	if o.Format == "nvfp4" && !s.QAD {
		return nil, fmt.Errorf("--format nvfp4: %s was not trained with quant: nvfp4 (no calibrated amax); train with QAD or export bf16", src)
	}
	rep := &ExportReport{}
	var tokDir string
	var genDirs []string // generation_config.json from the first that has one
	switch {
	case o.NoTokenizer:
		rep.Note = "tokenizer files not copied (--no-tokenizer)"
	case st == nil:
		// A plain HF directory: its own tokenizer and generation config.
		tokDir, genDirs = src, []string{src}
		if _, err := os.Stat(filepath.Join(src, "tokenizer.json")); err != nil {
			tokDir, rep.Note = "", fmt.Sprintf("%s has no tokenizer.json: no tokenizer files copied", src)
		}
	case st.TokenizerDir == "":
		genDirs = []string{st.InitFrom}
		rep.Note = fmt.Sprintf("the run knows only its tokenizer's fingerprint %s (no model.tokenizer directory): copy tokenizer.json and tokenizer_config.json into %s yourself", st.TokenizerFingerprint, out)
	default:
		tokDir, genDirs = st.TokenizerDir, []string{st.InitFrom, st.TokenizerDir}
		tk, err := tokenizer.Load(tokDir)
		if err != nil {
			return nil, fmt.Errorf("the run's tokenizer directory %s: %w: restore it, or give --no-tokenizer to export the weights alone", tokDir, err)
		}
		if tk.Fingerprint() != st.TokenizerFingerprint {
			return nil, fmt.Errorf("the run's tokenizer directory %s now holds tokenizer %s, but the run was trained with %s: restore it, or give --no-tokenizer to export the weights alone",
				tokDir, tk.Fingerprint(), st.TokenizerFingerprint)
		}
	}
	err = model.WriteDir(out, o.Force, func(tmp string) error {
		switch o.Format {
		case "nvfp4":
			if err := s.WriteNVFP4(tmp); err != nil {
				return err
			}
		default:
			if err := s.WriteHF(tmp, dt[o.Format]); err != nil {
				return err
			}
		}
		if tokDir != "" {
			n := 0
			for _, f := range tokenizerFiles {
				ok, err := copyIfExists(filepath.Join(tokDir, f), filepath.Join(tmp, f))
				if err != nil {
					return err
				}
				if ok {
					n++
				}
			}
			if n > 0 {
				rep.TokenizerFrom = tokDir
			}
		}
		for _, d := range genDirs {
			if d == "" {
				continue
			}
			ok, err := copyIfExists(filepath.Join(d, "generation_config.json"), filepath.Join(tmp, "generation_config.json"))
			if err != nil {
				return err
			}
			if ok {
				break
			}
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
