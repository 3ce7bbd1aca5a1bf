package trainer

import (
	"distill/compute"
	"fmt"
	"io"
	"path/filepath"

	"distill/train"
)

// checkpointer is the run's checkpoints: it finds the one a run resumes
// from and loads it, refusing one the config cannot continue; it saves
// them, and keeps the newest checkpoint.keep of them, and the last good
// one while updates are being skipped.
type checkpointer struct {
	runDir string
	keep   int
	// ordinal is the GPU a loaded student goes to (a data-parallel
	// rank's local rank).
	ordinal int
	// saved is the step of the newest checkpoint on disk; good the step
	// of the newest one not taken in a run of skipped updates (-1: none),
	// which retention keeps, so that the error of max_skipped_steps can
	// name it.
	saved, good int
}

// latest returns the checkpoint to resume from ("" for a new run), as
// resume (Options.Resume) allows.
func (c *checkpointer) latest(resume string) (string, error) {
	ckpt, err := LatestCheckpoint(c.runDir)
	if err != nil {
		return "", err
	}
	switch {
	case resume == "never" && ckpt != "":
		return "", fmt.Errorf("%w: %s already has checkpoints (newest %s); use another run_dir or resume", ErrResume, c.runDir, ckpt)
	case resume == "must" && ckpt == "":
		return "", fmt.Errorf("%w: %s has no checkpoint to resume from", ErrResume, c.runDir)
	}
	return ckpt, nil
}

// load reads checkpoint ckpt onto the run's backend and checks that cfg
// can continue it (checkResume).
func (c *checkpointer) load(cfg *Config, ckpt string, be compute.Backend, sh *train.Sharding, log io.Writer) (*train.Student, *State, error) {
	s, st, err := loadCheckpointSharded(ckpt, be, sh)
	if err != nil {
		return nil, nil, resumeError(ckpt, err)
	}
	if err := st.checkResume(cfg, s, ckpt, log); err != nil {
		return nil, nil, err
	}
	return s, st, nil
}

// newState is the State of a new run of cfg.
func newState(cfg *Config) *State {
	st := &State{DataSeed: cfg.Seed, LRSchedule: cfg.Optim.Schedule, LR: cfg.Optim.LR, MaxSteps: cfg.Train.MaxSteps}
	st.setBatching(cfg)
	st.setLoss(cfg)
	return st
}

// checkResume refuses a checkpoint that cfg cannot continue (another
// seed, QAD on or off, other batching, another architecture, a loss
// whose meaning changed), notes the changes a resume may make (the
// objective, the schedule), and takes cfg's.
func (st *State) checkResume(cfg *Config, s *train.Student, ckpt string, log io.Writer) error {
	if st.DataSeed != cfg.Seed {
		return fmt.Errorf("%w: %s was trained with seed %d, the config says %d", ErrResume, ckpt, st.DataSeed, cfg.Seed)
	}
	if err := st.checkLoRA(cfg, ckpt); err != nil {
		return err
	}
	if st.LoRA == nil && (st.QuantAmax != nil) != (cfg.Quant == "nvfp4") {
		return fmt.Errorf("%w: %s has NVFP4 state %v but the config says quant: %s", ErrResume, ckpt, st.QuantAmax != nil, cfg.Quant)
	}
	if err := st.checkBatching(cfg, ckpt); err != nil {
		return err
	}
	if err := checkArchitecture(cfg, s.Cfg, ckpt); err != nil {
		return err
	}
	if err := st.checkLoss(cfg, ckpt, log); err != nil {
		return err
	}
	st.setLoss(cfg)
	if cfg.Model.TokenizerFingerprint == "" {
		cfg.Model.TokenizerFingerprint = st.TokenizerFingerprint
	}
	// A run already at (or past) max_steps trains nothing (setup says
	// "nothing to do"): no loss curve leaves anything, so no notice.
	if st.Step < cfg.Train.MaxSteps && (st.LRSchedule != cfg.Optim.Schedule || st.LR != cfg.Optim.LR || st.MaxSteps != cfg.Train.MaxSteps) {
		fmt.Fprintf(log, "resume: the schedule changed (%s lr %g over %d steps -> %s lr %g over %d steps): the loss curve leaves the uninterrupted run's from here\n",
			st.LRSchedule, st.LR, st.MaxSteps, cfg.Optim.Schedule, cfg.Optim.LR, cfg.Train.MaxSteps)
	}
	st.LRSchedule, st.LR, st.MaxSteps = cfg.Optim.Schedule, cfg.Optim.LR, cfg.Train.MaxSteps
	return nil
}

// recordData records in st the data, teachers and tokenizer of the run
// (info: the source's), and refuses a resume (ckpt not "") on other data
// or other teachers: the saved data position would replay into another
// order, and the KD term would be another objective under the same name.
func (st *State) recordData(cfg *Config, info *SourceInfo, p *SourceParams, ckpt string, log io.Writer) error {
	m := &info.Manifest
	if ckpt != "" {
		if err := st.checkTeachers(info.Teachers, info.TeachersFrom, info.Where, ckpt, log); err != nil {
			return err
		}
	}
	st.setTeachers(info.Teachers)
	if ckpt == "" {
		st.CacheTeacher, st.CacheDataset = m.TeacherFingerprint, m.DatasetFingerprint
	} else if st.CacheTeacher != m.TeacherFingerprint || st.CacheDataset != m.DatasetFingerprint {
		return fmt.Errorf("%w: %s was trained on %s, %s: resume on the same data or start a new run_dir",
			ErrResume, ckpt, dataName(st.CacheTeacher, st.CacheDataset), configData(cfg, m))
	}
	fp := p.TokenizerFingerprint
	cfg.Model.TokenizerFingerprint, st.TokenizerFingerprint = fp, fp
	if p.TokenizerDir != "" {
		st.TokenizerDir = p.TokenizerDir
	}
	if cfg.Model.InitFrom != "" {
		if abs, err := filepath.Abs(cfg.Model.InitFrom); err == nil {
			st.InitFrom = abs
		}
	}
	return nil
}

// start sets the retention state of a run at st.Step: saved there if it
// resumed, and nothing good before a new run's first checkpoint.
func (c *checkpointer) start(st *State, resumed bool) {
	c.saved, c.good = st.Step, st.Step
	if !resumed {
		c.good = -1
	}
}

// save writes the checkpoint of st.Step (skipping: the step is in a run
// of skipped updates, so the last good checkpoint stays protected) and
// returns its directory.
func (c *checkpointer) save(s *train.Student, moments momentsOf, st *State, skipping bool) (string, error) {
	p, err := saveCheckpoint(c.runDir, s, moments, st, c.keep, c.protect(st.Step, skipping))
	if err != nil {
		return "", err
	}
	c.saved = st.Step
	if !skipping {
		c.good = st.Step
	}
	return p, nil
}

// protect is the step whose checkpoint retention keeps when step's is
// saved: step's own, or while updates are being skipped the last good
// one (-1: none yet).
func (c *checkpointer) protect(step int, skipping bool) int {
	switch {
	case !skipping:
		return step
	case c.good >= 0:
		return c.good
	}
	return -1
}

// lastGood names the last good checkpoint, for the error of a diverged
// run.
func (c *checkpointer) lastGood() string {
	if c.good < 0 {
		return "there is no checkpoint before them: start a new run"
	}
	return fmt.Sprintf("the last good checkpoint is %s (newer ones hold the same weights at a later data position)", checkpointDir(c.runDir, c.good))
}
