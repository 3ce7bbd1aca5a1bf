package trainer

import (
	"fmt"
	"path/filepath"

	"distill/compute"
	"distill/internal/errkind"
	"distill/model"
	"distill/train"
)

// LoRA runs (model.lora): the student is a frozen base and adapters
// (train.NewLoRAStudentOn). A checkpoint holds the adapters in PEFT's
// files (adapter_model.safetensors, adapter_config.json), their AdamW
// moments (optimizer.safetensors, as a full run's) and state.json, whose
// "lora" names the base by its content hash and where it came from
// (State.InitFrom, or the random init of config.json with a seed and
// std): no base weights. A resume or an export rebuilds the base from
// there and refuses one whose hash differs.

// LoRAState is what a LoRA checkpoint records of its adapters and base.
type LoRAState struct {
	Config train.LoRAConfig `json:"config"`
	// BaseHash is train.Student.BaseHash of the base trained on.
	BaseHash string `json:"base_sha256"`
	// Random: the base is model.Init of the checkpoint's config.json with
	// RandomSeed and RandomStd (model.random); else State.InitFrom.
	Random     bool    `json:"random,omitempty"`
	RandomSeed uint64  `json:"random_init_seed,omitempty"`
	RandomStd  float64 `json:"random_init_std,omitempty"`
	// InputAmax are the Linears' input amax calibrated at the run's
	// start (train.Student.InputAmax: four a layer), which the merged
	// model's NVFP4 export needs; absent in checkpoints made before
	// they were calibrated (a resume calibrates them).
	InputAmax []float32 `json:"input_amax,omitempty"`
}

// setLoRA records a LoRA student's adapters and base in st (nothing for
// a full student).
func (st *State) setLoRA(cfg *Config, s *train.Student) {
	lc := s.LoRA()
	if lc == nil {
		return
	}
	st.LoRA = &LoRAState{Config: *lc, BaseHash: s.BaseHash()}
	if r := cfg.Model.Random; r != nil {
		st.LoRA.Random, st.LoRA.RandomSeed, st.LoRA.RandomStd = true, r.InitSeed, r.InitStd
	}
}

// checkLoRA refuses a resume that would train another thing than the
// checkpoint's: a full fine-tune as LoRA or the reverse, other adapters
// (rank, alpha, targets, init), or a base held otherwise (quant).
func (st *State) checkLoRA(cfg *Config, ckpt string) error {
	lc := cfg.TrainLoRA()
	switch {
	case st.LoRA == nil && lc != nil:
		return fmt.Errorf("%w: %s is a full fine-tune (every weight trained), the config sets model.lora: a resume cannot turn it into LoRA; remove model.lora to continue it, or start a new run_dir with model.init_from: %s (its weights as the LoRA base)", ErrResume, ckpt, ckpt)
	case st.LoRA != nil && lc == nil:
		return fmt.Errorf("%w: %s holds LoRA adapters (rank %d on %v), the config has no model.lora: a resume cannot turn it into a full fine-tune; restore model.lora to continue it, or export the merged model (student export --format f32) and start a new run_dir from it", ErrResume, ckpt, st.LoRA.Config.Rank, st.LoRA.Config.Targets)
	case st.LoRA == nil:
		return nil
	}
	have := st.LoRA.Config
	for _, f := range []struct {
		key       string
		old, want any
	}{
		{"model.lora.rank", have.Rank, lc.Rank},
		{"model.lora.alpha", have.Alpha, lc.Alpha},
		{"model.lora.dropout", have.Dropout, lc.Dropout},
		{"model.lora.targets", have.Targets, lc.Targets},
		{"model.lora.init", have.Init, lc.Init},
		{"model.lora.seed", have.Seed, lc.Seed},
		{"quant (the base held NVFP4-quantized)", have.NVFP4, lc.NVFP4},
	} {
		if fmt.Sprint(f.old) != fmt.Sprint(f.want) {
			return fmt.Errorf("%w: %s was trained with %s = %v, the config says %v: a resume keeps the checkpoint's adapters; restore it or start a new run_dir", ErrResume, ckpt, f.key, f.old, f.want)
		}
	}
	return nil
}

// newLoRAStudent builds a new run's LoRA student: its base from
// model.init_from or model.random.
func newLoRAStudent(cfg *Config, be compute.Backend, lc train.LoRAConfig) (*train.Student, error) {
	if cfg.Model.InitFrom != "" {
		return loraFromDir(cfg.Model.InitFrom, be, lc)
	}
	mc, err := cfg.Model.Random.ModelConfig()
	if err != nil {
		return nil, err
	}
	r := cfg.Model.Random
	return loraRandom(mc, r.InitSeed, r.InitStd, be, lc)
}

// loraFromDir builds a LoRA student on the base of the HF checkpoint dir.
func loraFromDir(dir string, be compute.Backend, lc train.LoRAConfig) (*train.Student, error) {
	mc, err := model.LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	w, err := model.OpenWeights(dir)
	if err != nil {
		return nil, err
	}
	defer w.Close()
	if err := w.Check(mc); err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	s, err := train.NewLoRAStudentOn(mc, be, w.F32, lc)
	if err != nil {
		return nil, errkind.Errorf(ErrConfig, "%s: %w", dir, err)
	}
	return s, nil
}

// loraRandom builds a LoRA student on the random base model.Init makes.
func loraRandom(mc *model.Config, seed uint64, std float64, be compute.Backend, lc train.LoRAConfig) (*train.Student, error) {
	w := model.Init(mc, model.InitOptions{Seed: seed, Std: std})
	s, err := train.NewLoRAStudentOn(mc, be, func(name string) ([]float32, error) {
		v, ok := w[name]
		if !ok {
			// No ErrConfig here: the wrap below adds it to the chain
			// of the error this one comes back in.
			return nil, fmt.Errorf("random init has no tensor %s", name)
		}
		return v, nil
	}, lc)
	if err != nil {
		return nil, errkind.Wrap(ErrConfig, err)
	}
	return s, nil
}

// loadLoRACheckpoint rebuilds the LoRA student of checkpoint dir: its
// base from where st says, checked against the recorded hash, and the
// adapters from its PEFT files.
func loadLoRACheckpoint(dir string, st *State, be compute.Backend) (*train.Student, error) {
	l := st.LoRA
	var s *train.Student
	var err error
	from := st.InitFrom
	if l.Random {
		mc, err2 := model.LoadConfig(dir)
		if err2 != nil {
			return nil, damaged(err2)
		}
		from = fmt.Sprintf("the random init of %s (seed %d, std %g)", filepath.Join(dir, "config.json"), l.RandomSeed, l.RandomStd)
		s, err = loraRandom(mc, l.RandomSeed, l.RandomStd, be, l.Config)
	} else {
		if from == "" {
			return nil, fmt.Errorf("%w: %s: a LoRA checkpoint whose state.json names no base (init_from)", ErrResume, dir)
		}
		s, err = loraFromDir(from, be, l.Config)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %s: its base, %s: %w", ErrResume, dir, from, err)
	}
	if s.BaseHash() != l.BaseHash {
		s.Free()
		return nil, fmt.Errorf("%w: %s was trained on a base of content hash %.16s, but %s now has %.16s: the adapters belong to the base they were trained on; restore it (model.init_from) or start a new run_dir", ErrResume, dir, l.BaseHash, from, s.BaseHash())
	}
	if err := s.LoadAdapters(dir); err != nil {
		s.Free()
		return nil, damaged(err)
	}
	if l.InputAmax != nil {
		if err := s.RestoreInputAmax(l.InputAmax); err != nil {
			s.Free()
			return nil, fmt.Errorf("%w: %s: input_amax: %w", ErrResume, dir, err)
		}
	}
	return s, nil
}

// peftBase is adapter_config.json's base_model_name_or_path: the base's
// directory (or, for a random base, a note saying so).
func peftBase(st *State) string {
	if st != nil && st.LoRA != nil && st.LoRA.Random {
		return fmt.Sprintf("random init (seed %d, std %g) of config.json; base sha256 %s", st.LoRA.RandomSeed, st.LoRA.RandomStd, st.LoRA.BaseHash)
	}
	if st != nil {
		return st.InitFrom
	}
	return ""
}
