package trainer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"gopkg.in/yaml.v3"

	"distill/compute"
	"distill/compute/device"
	"distill/internal/atomicfile"
	"distill/internal/errkind"
	"distill/model"
	"distill/train"
	"distill/train/loss"
	"distill/train/optim"
)

// State is what a checkpoint holds beside the weights and the optimizer
// moments (state.json).
type State struct {
	Step     int   `json:"step"`      // optimizer steps done
	OptSteps int   `json:"opt_steps"` // AdamW's bias-correction count (steps skipped for a non-finite norm excluded)
	Tokens   int64 `json:"tokens"`    // training tokens consumed
	// Data position: the epoch and how many samples its iterator yielded.
	// The data order is the RNG state of this trainer, a pure function
	// of (DataSeed + Epoch); a LoRA student's dropout masks are keyed by
	// the step and row (and the config), so they hold no state either.
	Epoch    int    `json:"epoch"`
	EpochPos int64  `json:"epoch_pos"`
	DataSeed uint64 `json:"data_seed"`
	// Schedule in force: a resume may change it (to train longer, say),
	// and is told that the loss curve then leaves the uninterrupted one's.
	LRSchedule string  `json:"lr_schedule"`
	LR         float64 `json:"lr_peak"`
	MaxSteps   int     `json:"max_steps"`
	// Batching: the data position replays only with the same rows, so a
	// resume that changes any of these is refused.
	SeqLen            int     `json:"seq_len,omitempty"`
	GlobalBatchTokens int     `json:"global_batch_tokens,omitempty"`
	ShuffleWindow     int     `json:"shuffle_window,omitempty"`
	Truncate          bool    `json:"truncate,omitempty"`
	EvalRange         []int64 `json:"eval_range,omitempty"`
	// ChunkSamples is distill.chunk_samples of an online run: the
	// chunking its order is made of.
	ChunkSamples int64 `json:"online_chunk_samples,omitempty"`
	// Recompute is the activation recomputation the run trained with
	// (train.recompute's choice): train.recompute auto keeps it on resume
	// when it fits, so that the resumed steps run the same kernels on the
	// same buffers.
	Recompute string `json:"recompute,omitempty"`
	// QuantAmax is the frozen NVFP4 amax of every quantizer (QAD runs).
	QuantAmax []float32 `json:"quant_amax,omitempty"`
	// The data trained on: resuming on other data would replay the data
	// position into a different order. A dataset run (data.dataset) has
	// no teacher (CacheTeacher is empty) and CacheDataset is the
	// dataset's fingerprint (package data).
	CacheTeacher         string `json:"cache_teacher_fingerprint"`
	CacheDataset         string `json:"cache_dataset_fingerprint"`
	TokenizerFingerprint string `json:"tokenizer_fingerprint"`
	// Where the student's tokenizer and initial weights came from
	// (absolute paths, when the run knew them): `student export` copies
	// the tokenizer files and generation_config.json from there.
	TokenizerDir string `json:"tokenizer_dir,omitempty"`
	InitFrom     string `json:"init_from,omitempty"`
	// ChatTemplate is the Jinja source of data.dataset.chat_template (the
	// template the samples were rendered with, overriding the
	// tokenizer's); `student export` writes it into the exported
	// tokenizer files. "" when the tokenizer's own template was used.
	ChatTemplate string `json:"chat_template,omitempty"`
	// The objective: loss.Definition numbers what each (kd_loss, tail)
	// meant when the checkpoint was written (absent: 1, before tail zero
	// existed), so a resume under a tail whose meaning changed since is
	// refused rather than silently training something else.
	LossDefinition int     `json:"loss_definition,omitempty"`
	KDLoss         string  `json:"kd_loss,omitempty"`
	Tail           string  `json:"tail,omitempty"`
	Temperature    float64 `json:"temperature,omitempty"` // distill.temperature (absent: before it was recorded)
	// Teachers of multi-teacher KD (data.caches), in order; absent with
	// one teacher (data.cache) or none (data.dataset).
	Teachers []TeacherState `json:"teachers,omitempty"`
	// LoRA is a LoRA run's adapters and base (model.lora); absent for a
	// full fine-tune.
	LoRA *LoRAState `json:"lora,omitempty"`
}

// TeacherState is one teacher of a multi-teacher run, as a checkpoint
// records it.
type TeacherState struct {
	Name        string  `json:"name"`
	Fingerprint string  `json:"teacher_fingerprint"`
	Weight      float64 `json:"weight"`
}

// setTeachers records the teachers of a multi-teacher run (nil: one
// teacher or none).
func (st *State) setTeachers(ts []TeacherState) {
	st.Teachers = ts
}

// teacherStates are the teachers of ts as a checkpoint records them.
func (ts *teacherSet) states() []TeacherState {
	if ts == nil {
		return nil
	}
	var out []TeacherState
	for i := range ts.rds {
		out = append(out, TeacherState{Name: ts.names[i], Fingerprint: ts.ms[i].TeacherFingerprint, Weight: ts.weights[i]})
	}
	return out
}

// checkTeachers refuses a resume whose teachers differ from the
// checkpoint's (another number of teachers, or another teacher at a
// position): the KD term would be another objective under the same
// name. cur are the config's teachers (from data.caches or
// distill.teachers, named by src), where(i) names teacher i. A change of
// weights is allowed and noted on log, like a change of kd_loss.
func (st *State) checkTeachers(cur []TeacherState, src string, where func(int) string, ckpt string, log io.Writer) error {
	n := len(cur)
	fresh := fmt.Sprintf("restore the config's teachers (data.caches or distill.teachers), or start a new run_dir from these weights (model.init_from: %s)", ckpt)
	switch {
	case len(st.Teachers) == 0 && n == 0:
		return nil
	case len(st.Teachers) == 0:
		return fmt.Errorf("%w: %s was trained with one teacher but the config has %d teachers in %s: %s", ErrResume, ckpt, n, src, fresh)
	case n == 0:
		return fmt.Errorf("%w: %s was trained with %d teachers (data.caches or distill.teachers) but the config has one or none: %s", ErrResume, ckpt, len(st.Teachers), fresh)
	case n != len(st.Teachers):
		return fmt.Errorf("%w: %s was trained with %d teachers, the config has %d in %s: %s", ErrResume, ckpt, len(st.Teachers), n, src, fresh)
	}
	var changed []string
	for i, t := range st.Teachers {
		if fp := cur[i].Fingerprint; fp != t.Fingerprint {
			return fmt.Errorf("%w: %s was trained with teacher %.12s (%s) as %s[%d], the config has %s with teacher %.12s: %s",
				ErrResume, ckpt, t.Fingerprint, t.Name, src, i, where(i), fp, fresh)
		}
		if w := cur[i].Weight; w != t.Weight {
			changed = append(changed, fmt.Sprintf("%s %g -> %g", cur[i].Name, t.Weight, w))
		}
	}
	if len(changed) > 0 {
		fmt.Fprintf(log, "resume: teacher weights changed (%s): the loss curve leaves the uninterrupted run's from here\n", strings.Join(changed, ", "))
	}
	return nil
}

// setLoss records the objective of cfg under this build's definitions.
func (st *State) setLoss(cfg *Config) {
	st.LossDefinition, st.KDLoss, st.Tail = loss.Definition, cfg.Distill.KDLoss, cfg.Distill.Tail
	st.Temperature = cfg.Distill.Temperature
}

// checkLoss refuses a resume whose distill.tail names an objective other
// than the one the checkpoint was trained under, and notes on log a
// deliberate change of kd_loss or tail (allowed, like a schedule change).
func (st *State) checkLoss(cfg *Config, ckpt string, log io.Writer) error {
	d := cfg.Distill
	switch {
	case st.LossDefinition > loss.Definition:
		return fmt.Errorf("%w: %s was written under loss definition %d, newer than this build's %d: its distill.tail %q may mean something this build does not compute; resume it with the build that wrote it",
			ErrResume, ckpt, st.LossDefinition, loss.Definition, st.Tail)
	case st.LossDefinition < 2 && d.Tail == string(loss.Renormalize):
		return fmt.Errorf("%w: %s was written before distill.tail: renormalize changed meaning: it then renormalized only the teacher over its top-k "+
			"(with kd_loss fwd_kl that is what tail: zero means now; with rev_kl or jsd it was no proper divergence), and now it renormalizes the student as well. "+
			"To continue the old fwd_kl objective set distill.tail: zero; to train under the new renormalize start a new run_dir from these weights (model.init_from: %s)",
			ErrResume, ckpt, ckpt)
	}
	if st.Tail != "" && (st.Tail != d.Tail || st.KDLoss != d.KDLoss) {
		fmt.Fprintf(log, "resume: the objective changed (kd_loss %s, tail %s -> kd_loss %s, tail %s): the loss curve leaves the uninterrupted run's from here\n",
			st.KDLoss, st.Tail, d.KDLoss, d.Tail)
	}
	return nil
}

// setBatching records the batching settings of cfg.
func (st *State) setBatching(cfg *Config) {
	d := cfg.Data
	st.SeqLen, st.GlobalBatchTokens, st.ShuffleWindow, st.Truncate = d.SeqLen, d.GlobalBatchTokens, d.ShuffleWindow, d.Truncate
	st.EvalRange = append([]int64(nil), d.EvalRange...)
	st.ChunkSamples = 0
	if cfg.online() {
		st.ChunkSamples = cfg.Distill.ChunkSamples
	}
}

// checkBatching refuses a resume whose batching differs from the
// checkpoint's: the saved data position would replay into other rows.
// Checkpoints written before these fields existed (SeqLen 0) are not
// checked.
func (st *State) checkBatching(cfg *Config, ckpt string) error {
	if st.SeqLen == 0 {
		return nil
	}
	d := cfg.Data
	for _, f := range []struct {
		key      string
		old, new any
	}{
		{"data.seq_len", st.SeqLen, d.SeqLen},
		{"data.global_batch_tokens", st.GlobalBatchTokens, d.GlobalBatchTokens},
		{"data.shuffle_window", st.ShuffleWindow, d.ShuffleWindow},
		{"data.truncate", st.Truncate, d.Truncate},
		{"data.eval_range", yamlInts(st.EvalRange), yamlInts(d.EvalRange)},
		{"distill.chunk_samples", st.ChunkSamples, onlineChunks(cfg)},
	} {
		if fmt.Sprint(f.old) != fmt.Sprint(f.new) {
			return fmt.Errorf("%w: %s was trained with %s = %v, the config says %v: the saved data position replays only with the same batching; restore it or start a new run_dir",
				ErrResume, ckpt, f.key, f.old, f.new)
		}
	}
	return nil
}

const ckptPrefix = "step-"

// checkpointDir is RUN_DIR/checkpoints/step-NNNNNNNN.
func checkpointDir(runDir string, step int) string {
	return filepath.Join(runDir, "checkpoints", fmt.Sprintf("%s%08d", ckptPrefix, step))
}

// LatestCheckpoint returns the newest complete checkpoint under runDir, or
// "" if there is none. Incomplete ones cannot exist under their final
// name: a checkpoint is renamed into place only after all of it is synced.
func LatestCheckpoint(runDir string) (string, error) {
	steps, err := listCheckpoints(runDir)
	if err != nil || len(steps) == 0 {
		return "", err
	}
	return checkpointDir(runDir, steps[len(steps)-1]), nil
}

func listCheckpoints(runDir string) ([]int, error) {
	ents, err := os.ReadDir(filepath.Join(runDir, "checkpoints"))
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var steps []int
	for _, e := range ents {
		if n, ok := strings.CutPrefix(e.Name(), ckptPrefix); ok && e.IsDir() {
			if s, err := strconv.Atoi(n); err == nil {
				steps = append(steps, s)
			}
		}
	}
	sort.Ints(steps)
	return steps, nil
}

// saveCheckpoint writes the student (F32 master weights as an HF
// directory, so `student export` and infer.Load read it), the AdamW
// moments and st into a temporary directory, syncs every file and the
// directory, renames it to step-NNNNNNNN and syncs the parent: a crash at
// any point leaves the previous checkpoints intact and no partial one
// under a final name. Then it deletes all but the newest keep, and the
// one of step protect (the last good checkpoint while updates are being
// skipped; -1 for none).
func saveCheckpoint(runDir string, s *train.Student, moments momentsOf, st *State, keep, protect int) (string, error) {
	parent := filepath.Join(runDir, "checkpoints")
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", err
	}
	final := checkpointDir(runDir, st.Step)
	tmp := filepath.Join(parent, fmt.Sprintf(".tmp-%s%08d-%d", ckptPrefix, st.Step, os.Getpid()))
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return "", err
	}
	err := func() error {
		// Host values on any backend: views on the CPU, downloads from a
		// GPU, so that a checkpoint moves between devices.
		var ts []model.Tensor
		if s.LoRA() != nil {
			// The adapters alone, in PEFT's files; the base is named in
			// state.json by its content hash.
			if err := s.WritePEFT(tmp, peftBase(st)); err != nil {
				return err
			}
		} else {
			w := s.Weights()
			for _, t := range s.Tensors {
				ts = append(ts, model.F32Tensor(t.Name, t.Shape, w[t.Name]))
			}
			if err := model.WriteSafetensors(filepath.Join(tmp, "model.safetensors"), ts, map[string]string{"format": "pt"}); err != nil {
				return err
			}
		}
		ts = ts[:0]
		for i, t := range s.Tensors {
			m, v := moments(i)
			ts = append(ts, model.F32Tensor("exp_avg."+t.Name, t.Shape, m), model.F32Tensor("exp_avg_sq."+t.Name, t.Shape, v))
		}
		if err := model.WriteSafetensors(filepath.Join(tmp, "optimizer.safetensors"), ts, nil); err != nil {
			return err
		}
		return publishCheckpoint(tmp, final, s, st, nil)
	}()
	if err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("saving checkpoint of step %d: %w", st.Step, err)
	}
	return final, pruneCheckpoints(runDir, keep, protect)
}

// pruneCheckpoints deletes all but the newest keep checkpoints of runDir,
// and the one of step protect (-1 for none).
func pruneCheckpoints(runDir string, keep, protect int) error {
	steps, err := listCheckpoints(runDir)
	if err != nil {
		return err
	}
	for i, n := 0, len(steps); n > keep && i < len(steps); i++ {
		if steps[i] != protect {
			os.RemoveAll(checkpointDir(runDir, steps[i]))
			n--
		}
	}
	return nil
}

// publishCheckpoint writes config.json, state.json and (a sharded
// checkpoint) manifest.json beside the weights in tmp, syncs every file
// and the directory, renames tmp to final and syncs the parent: a crash
// at any point leaves no partial checkpoint under a final name.
func publishCheckpoint(tmp, final string, s *train.Student, st *State, man *shardManifest) error {
	cj, err := s.Cfg.JSONF32() // the weights are the F32 masters
	if err != nil {
		return err
	}
	if err := writeFileSync(filepath.Join(tmp, "config.json"), append(cj, '\n')); err != nil {
		return err
	}
	jsons := map[string]any{"state.json": st}
	if man != nil {
		jsons[shardManifestName] = man
	}
	for name, v := range jsons {
		b, _ := json.MarshalIndent(v, "", "  ")
		if err := writeFileSync(filepath.Join(tmp, name), append(b, '\n')); err != nil {
			return err
		}
	}
	if err := atomicfile.Sync(tmp); err != nil {
		return err
	}
	if testHookPublish != nil {
		testHookPublish(st.Step)
	}
	os.RemoveAll(final) // a step re-saved after a resume from an older checkpoint
	if err := os.Rename(tmp, final); err != nil {
		return err
	}
	return atomicfile.Sync(filepath.Dir(final))
}

// testHookPublish, when set (tests), runs when a checkpoint's files are
// synced in its temporary directory, just before the rename that
// publishes it: a crash test holds the process there to kill it mid-save.
var testHookPublish func(step int)

// loadCheckpoint reads a checkpoint written by saveCheckpoint onto be.
func loadCheckpoint(dir string, be compute.Backend) (*train.Student, *State, error) {
	return loadCheckpointSharded(dir, be, nil)
}

// loadCheckpointSharded is loadCheckpoint for one rank of a ZeRO stage 2
// or 3 group when sh is set: the rank keeps its part of the weights.
func loadCheckpointSharded(dir string, be compute.Backend, sh *train.Sharding) (*train.Student, *State, error) {
	pst, err := loadState(dir)
	if err != nil {
		return nil, nil, err
	}
	st := *pst
	var s *train.Student
	switch {
	case st.LoRA != nil && sh != nil:
		return nil, nil, fmt.Errorf("%w: %s is a LoRA checkpoint: ZeRO stages 2 and 3 do not shard LoRA students; use train.zero 0 or 1", ErrResume, dir)
	case st.LoRA != nil:
		s, err = loadLoRACheckpoint(dir, &st, be)
		if err != nil {
			return nil, nil, err
		}
		return s, &st, nil
	case isSharded(dir):
		s, err = loadShardedStudent(dir, be, sh)
	case sh != nil:
		s, err = train.LoadHFSharded(dir, be, *sh)
	default:
		s, err = train.LoadHFOn(dir, be)
	}
	if err != nil {
		if errors.Is(err, compute.ErrOutOfMemory) {
			return nil, nil, fmt.Errorf("%w: %w", ErrResume, err)
		}
		return nil, nil, damaged(err)
	}
	if st.QuantAmax != nil {
		if err := s.RestoreQAD(st.QuantAmax); err != nil {
			return nil, nil, fmt.Errorf("%w: %s: %w", ErrResume, dir, err)
		}
	}
	return s, &st, nil
}

// errDamaged marks a checkpoint whose files do not read back as they
// were saved: state.json, the weights, a LoRA run's adapters or the
// optimizer's moments missing, truncated or unparsable (not a checkpoint
// this config cannot continue: ErrResume, nor a base model that moved).
// Its message is the file's error alone: a resume adds ErrResume and the
// way on (resumeError), an export or eval the run's earlier checkpoint
// (LoadStudentOn); they said "cannot resume: ..." for an export too, and
// a resume named no checkpoint to go on from.
var errDamaged = errors.New("checkpoint damaged")

// damaged marks err, an error reading a checkpoint's files, errDamaged.
func damaged(err error) error { return errkind.Wrap(errDamaged, err) }

// previousCheckpoint is the newest checkpoint of ckpt's run before ckpt
// ("" when there is none, or ckpt is not RUN/checkpoints/step-N).
func previousCheckpoint(ckpt string) string {
	ckpt = filepath.Clean(ckpt)
	n, ok := strings.CutPrefix(filepath.Base(ckpt), ckptPrefix)
	step, err := strconv.Atoi(n)
	if !ok || err != nil || filepath.Base(filepath.Dir(ckpt)) != "checkpoints" {
		return ""
	}
	run := filepath.Dir(filepath.Dir(ckpt))
	steps, _ := listCheckpoints(run)
	for i := len(steps) - 1; i >= 0; i-- {
		if steps[i] < step {
			return checkpointDir(run, steps[i])
		}
	}
	return ""
}

// resumeError is err, the error of resuming from checkpoint ckpt, as
// ErrResume; one of a damaged checkpoint says how to go on: from the
// checkpoint before it, once this one is moved out of checkpoints/
// (the newest one is what a resume takes), or, when it is the run's
// only one, from a copy or in a new run_dir.
func resumeError(ckpt string, err error) error {
	if err == nil {
		return nil
	}
	if !errors.Is(err, ErrResume) {
		err = fmt.Errorf("%w: %w", ErrResume, err)
	}
	if !errors.Is(err, errDamaged) {
		return err
	}
	ckpt = filepath.Clean(ckpt)
	if prev := previousCheckpoint(ckpt); prev != "" {
		aside := filepath.Join(filepath.Dir(filepath.Dir(ckpt)), filepath.Base(ckpt)+".damaged")
		return fmt.Errorf("%w: checkpoint %s is damaged (a file missing, truncated or changed since it was saved); to resume from the one before it, %s, move it out of checkpoints/ (mv %s %s) and run the same command again",
			err, ckpt, prev, ckpt, aside)
	}
	return fmt.Errorf("%w: checkpoint %s is damaged (a file missing, truncated or changed since it was saved), and it is the run's only one: restore it from a copy, or start over in a new run_dir (--run-dir)", err, ckpt)
}

// loadState reads a checkpoint's state.json.
func loadState(dir string) (*State, error) {
	var st State
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err != nil {
		return nil, damaged(fmt.Errorf("%s: %w", dir, err))
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, damaged(fmt.Errorf("%s/state.json: %w", dir, err))
	}
	return &st, nil
}

// momentsOf returns the AdamW moments of the student's tensor i (in
// Student.Tensors' order) on the host: the optimizer's (AdamW.Moments),
// or under ZeRO-1 those gathered from the ranks.
type momentsOf func(i int) (m, v []float32)

// loadMoments fills the AdamW moments from a checkpoint (either
// layout). at, when not nil, says where the optimizer's group i lies in
// the checkpoint's tensor of its name (offset, the tensor's length: a
// ZeRO-1 or sharded rank's pieces); nil: each group is a whole tensor.
func loadMoments(dir string, ad *optim.AdamW, steps int, at func(i int) (off, full int)) error {
	read, done, err := momentSource(dir)
	if err != nil {
		return err
	}
	defer done()
	for i, g := range ad.Groups {
		off, full := 0, g.P.Len()
		if at != nil {
			off, full = at(i)
		}
		var mv [2][]float32
		for j, name := range []string{"exp_avg." + g.Name, "exp_avg_sq." + g.Name} {
			mv[j] = make([]float32, g.P.Len())
			if err := read(name, full, off, mv[j]); err != nil {
				return err
			}
		}
		if err := ad.SetMoments(i, mv[0], mv[1]); err != nil {
			return fmt.Errorf("%w: %s: %w", ErrResume, dir, err)
		}
	}
	ad.Steps = steps
	return nil
}

// momentSource reads the moments of checkpoint dir: read fills dst with
// elements [off, off+len(dst)) of tensor name (exp_avg.X or
// exp_avg_sq.X) of full elements; done closes the files.
func momentSource(dir string) (read func(name string, full, off int, dst []float32) error, done func(), err error) {
	if isSharded(dir) {
		c, err := openSharded(dir)
		if err != nil {
			return nil, nil, damaged(err)
		}
		return c.read, c.close, nil
	}
	// OpenWeights reads a directory's model.safetensors; give it the
	// optimizer file alone.
	ow, err := openFile(filepath.Join(dir, "optimizer.safetensors"))
	if err != nil {
		return nil, nil, err
	}
	read = func(name string, full, off int, dst []float32) error {
		v, err := ow.F32(name)
		if err != nil {
			return damaged(fmt.Errorf("%s/optimizer.safetensors: %w", dir, err))
		}
		if len(v) != full {
			return damaged(fmt.Errorf("%s/optimizer.safetensors: %s has %d values, want %d", dir, name, len(v), full))
		}
		copy(dst, v[off:])
		return nil
	}
	return read, func() { ow.Close() }, nil
}

// openFile opens one safetensors file through OpenWeights on a private
// directory holding only a link to it.
func openFile(path string) (*model.Weights, error) {
	d, err := os.MkdirTemp("", "distill-opt-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(d)
	if _, err := os.Stat(path); err != nil {
		return nil, damaged(err) // it named the link: /tmp/distill-opt-N/model.safetensors
	}
	abs, _ := filepath.Abs(path)
	link := filepath.Join(d, "model.safetensors")
	if err := os.Symlink(abs, link); err != nil {
		return nil, err
	}
	w, err := model.OpenWeights(d)
	if err != nil {
		return nil, damaged(fmt.Errorf("%s", strings.ReplaceAll(err.Error(), link, path)))
	}
	return w, nil
}

// runLock is a held flock on RUN_DIR/train.lock.
type runLock struct{ f *os.File }

// lockRunDir takes the run directory's exclusive lock, or says who holds
// it. The kernel drops the lock when its holder exits, however it exits,
// so a killed trainer never leaves the directory locked.
func lockRunDir(dir string) (*runLock, error) {
	path := filepath.Join(dir, "train.lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("locking run_dir: %w", err)
	}
	for {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		if err == syscall.EWOULDBLOCK {
			holder, _ := os.ReadFile(path)
			who := strings.TrimSpace(string(holder))
			if who == "" {
				who = "another process"
			}
			return nil, fmt.Errorf("%w: %s is locked by %s (%s): two trainers must not share a run_dir; wait for it to end, stop it, or use another run_dir",
				ErrLocked, dir, who, path)
		}
		return nil, fmt.Errorf("locking %s: %w", path, err)
	}
	host, _ := os.Hostname()
	who := fmt.Sprintf("pid %d on %s since %s: %s", os.Getpid(), host, time.Now().Format(time.RFC3339), strings.Join(os.Args, " "))
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(who+"\n"), 0)
	}
	return &runLock{f: f}, nil
}

// unlock releases the lock (closing the file drops the flock). The file
// stays: removing it would race with a trainer that just opened it.
func (l *runLock) unlock() {
	l.f.Truncate(0)
	l.f.Close()
}

func writeFileSync(path string, data []byte) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// LoadStudent opens a trained student for eval and export: path is a run
// directory (its newest checkpoint), a checkpoint directory, or any HF
// checkpoint directory. A checkpoint's state.json, when present, restores
// the NVFP4 QAD state, so the student runs fake-quantized as in training;
// the returned State is nil for a plain HF directory. The student is on
// the CPU; LoadStudentOn puts it on another backend.
func LoadStudent(path string) (*train.Student, *State, error) {
	return LoadStudentOn(path, device.CPU(0))
}

// LoadStudentOn is LoadStudent onto the backend be (student eval
// --device: a GPU's).
func LoadStudentOn(path string, be compute.Backend) (*train.Student, *State, error) {
	if _, err := os.Stat(path); err != nil {
		return nil, nil, fmt.Errorf("%s: no such run or checkpoint directory (%w)", path, err)
	}
	_, ckErr := os.Stat(filepath.Join(path, "checkpoints"))
	_, cfgErr := os.Stat(filepath.Join(path, "config.yaml"))
	_, hfErr := os.Stat(filepath.Join(path, "config.json"))
	if ckErr == nil || (cfgErr == nil && hfErr != nil) {
		// A run directory (config.yaml, no config.json of its own): its
		// newest checkpoint, which a run that stopped before its first
		// save does not have.
		ck, err := LatestCheckpoint(path)
		if err != nil {
			return nil, nil, err
		}
		if ck == "" {
			return nil, nil, fmt.Errorf("run directory %s has no checkpoint yet: its run stopped before its first save (checkpoint.every steps; a run saves one too when it finishes or is stopped by Ctrl-C or SIGTERM): run student train on it until it saves one, or give a checkpoint directory", path)
		}
		path = ck
	}
	if _, err := os.Stat(filepath.Join(path, "state.json")); err == nil {
		s, st, err := loadCheckpoint(path, be)
		if errors.Is(err, errDamaged) {
			if prev := previousCheckpoint(path); prev != "" {
				return nil, nil, fmt.Errorf("%w: checkpoint %s is damaged (a file missing, truncated or changed since it was saved); the run's checkpoint before it: --checkpoint %s", err, path, prev)
			}
			return nil, nil, fmt.Errorf("%w: checkpoint %s is damaged (a file missing, truncated or changed since it was saved), and its run has no earlier one", err, path)
		}
		return s, st, err
	}
	if ckErr != nil && cfgErr != nil && hfErr != nil {
		// Not a run, a checkpoint or an HF directory (a run's parent,
		// say): "open DIR/config.json: no such file" said only half.
		return nil, nil, fmt.Errorf("%s is neither a student train run directory (no checkpoints/ or config.yaml) nor a checkpoint (no config.json): give a run directory (its run_dir or --run-dir), one of its checkpoints/step-N, or an HF checkpoint directory", path)
	}
	s, err := train.LoadHFOn(path, be)
	return s, nil, err
}

// onlineChunks is distill.chunk_samples of an online run, 0 otherwise.
func onlineChunks(cfg *Config) int64 {
	if cfg.online() {
		return cfg.Distill.ChunkSamples
	}
	return 0
}

// TrainedLoss is the objective the student at path (as LoadStudent takes
// it: a run directory, one of its checkpoints, or an HF directory) was
// trained under, as distill overrides for LoadEvalConfig
// ("distill.KEY=VALUE"), and the files they were read from (from is ""
// and sets nil when path records no training run: an HF directory).
// The run's config.yaml gives the distill section; the checkpoint's
// state.json, when it records them, gives kd_loss, tail and temperature
// over it (config.yaml is the last run's, which a resume may have
// changed).
func TrainedLoss(path string) (sets []string, from []string, err error) {
	runDir, ckpt, err := runDirOf(path)
	if err != nil {
		return nil, nil, err
	}
	d := map[string]string{}
	if runDir != "" {
		p := filepath.Join(runDir, "config.yaml")
		b, err := os.ReadFile(p)
		switch {
		case err == nil:
			var c struct {
				Distill *DistillConfig `yaml:"distill"`
			}
			if err := yaml.Unmarshal(b, &c); err != nil {
				return nil, nil, fmt.Errorf("%s: %v (the run's resolved config; give the loss with --config or the loss flags)", p, err)
			}
			if c.Distill != nil {
				x := c.Distill
				d["kd_loss"], d["tail"] = strconv.Quote(x.KDLoss), strconv.Quote(x.Tail)
				d["jsd_beta"], d["temperature"] = fmtFloat(x.JSDBeta), fmtFloat(x.Temperature)
				d["kd_weight"], d["sft_weight"] = fmtFloat(x.KDWeight), fmtFloat(x.SFTWeight)
				d["scale_t2"] = strconv.FormatBool(x.ScaleT2)
				from = append(from, p)
			}
		case !os.IsNotExist(err):
			return nil, nil, err
		}
	}
	if ckpt != "" {
		p := filepath.Join(ckpt, "state.json")
		b, err := os.ReadFile(p)
		switch {
		case err == nil:
			var st State
			if err := json.Unmarshal(b, &st); err != nil {
				return nil, nil, fmt.Errorf("%s: %v", p, err)
			}
			if st.KDLoss != "" {
				d["kd_loss"] = strconv.Quote(st.KDLoss)
			}
			if st.Tail != "" {
				d["tail"] = strconv.Quote(st.Tail)
			}
			if st.Temperature != 0 {
				d["temperature"] = fmtFloat(st.Temperature)
			}
			if st.KDLoss != "" || st.Tail != "" || st.Temperature != 0 {
				from = append([]string{p}, from...)
			}
		case !os.IsNotExist(err):
			return nil, nil, err
		}
	}
	for _, k := range []string{"kd_loss", "jsd_beta", "tail", "temperature", "scale_t2", "kd_weight", "sft_weight"} {
		if v, ok := d[k]; ok {
			sets = append(sets, "distill."+k+"="+v)
		}
	}
	return sets, from, nil
}

// runDirOf splits path as LoadStudent takes it into the run directory
// ("" when path is no run's: an HF directory, or a checkpoint moved out
// of its run) and the checkpoint (the run's newest for a run directory;
// "" when it has none yet).
func runDirOf(path string) (runDir, ckpt string, err error) {
	if _, err := os.Stat(filepath.Join(path, "checkpoints")); err == nil {
		ckpt, err := LatestCheckpoint(path)
		return path, ckpt, err
	}
	if clean := filepath.Clean(path); filepath.Base(filepath.Dir(clean)) == "checkpoints" {
		return filepath.Dir(filepath.Dir(clean)), path, nil
	}
	return "", path, nil
}

func fmtFloat(x float64) string { return strconv.FormatFloat(x, 'g', -1, 64) }
