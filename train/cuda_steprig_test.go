package train

import (
	"testing"

	"distill/compute"
	"distill/model"
	"distill/model/decoder"
	"distill/train/loss"
	"distill/train/optim"
)

// stepCase is a tiny student of the CUDA step tests: its config,
// recompute mode, NVFP4 QAD, and LoRA (lora >= 0: adapters on every
// target with that dropout; < 0: a full student).
type stepCase struct {
	cfg       *model.Config
	recompute decoder.Recompute
	qad       bool
	lora      float64
}

// stepRig is a stepCase's student on a backend, with its batch, loss
// options and optimizer.
type stepRig struct {
	s       *Student
	b       *Batch
	opt     loss.Options
	ad      *optim.AdamW
	dropout bool // LoRA dropout: masks drawn per step
}

// rig builds c's student on be from seed-3 weights (std 0.1, perturbed),
// testBatch(4), a KD + SFT loss (QAD calibrated on the batch) and AdamW.
// The caller frees r.s.
func (c stepCase) rig(t *testing.T, be compute.Backend) *stepRig {
	t.Helper()
	w := model.Init(c.cfg, model.InitOptions{Seed: 3, Std: 0.1, Perturb: true})
	r := &stepRig{dropout: c.lora > 0}
	var err error
	if c.lora >= 0 {
		lc := LoRAConfig{Rank: 4, Alpha: 8, Targets: allTargets, Init: "kaiming", Seed: 1, Dropout: c.lora}
		if r.s, err = NewLoRAStudentOn(c.cfg, be, mapSource(w), lc); err != nil {
			t.Fatal(err)
		}
	} else {
		if r.s, err = NewStudentOn(c.cfg, be); err != nil {
			t.Fatal(err)
		}
		if err := r.s.Load(w); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.s.Model.SetRecompute(c.recompute); err != nil {
		t.Fatal(err)
	}
	r.b = testBatch(4, c.cfg.VocabSize, 8)
	r.opt = loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	if c.qad {
		calibrateQAD(t, r.s, &r.opt, r.b)
	}
	r.ad, _ = optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.01}, r.s.Groups())
	return r
}

// forwardBackward is step's gradients: zeroed, then the batch's forward
// and backward (a LoRA student's dropout masks drawn for the step).
func (r *stepRig) forwardBackward(t *testing.T, step int) loss.Stats {
	t.Helper()
	if r.dropout {
		r.s.SetStepRow(step, 0)
	}
	r.s.ZeroGrad()
	st, err := r.s.ForwardBackward(r.b, &r.opt, 0)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// update clips the gradients at norm 1 and takes an AdamW step at 3e-3.
func (r *stepRig) update() {
	optim.ClipGradNorm(r.s.Groups(), 1)
	r.ad.Step(3e-3)
}
