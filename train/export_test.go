package train

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"distill/compute"
	"distill/compute/device"
	"distill/infer"
	"distill/model"
	"distill/model/decoder"
	"distill/train/loss"
)

// TestExportBF16: the exported checkpoint loads into the teacher forward
// (infer.Load, a separate implementation) and gives the trainer's
// log-probs within BF16 rounding: exactly, the trainer's log-probs with its
// weights rounded to BF16, up to fp32 arithmetic order (atol 2e-4). For
// weights off the BF16 grid, the test also checks that the unrounded
// trainer differs by more than that, so the rounding is really exercised.
func TestExportBF16(t *testing.T) {
	for _, c := range []struct {
		arch model.Arch
		tied bool
	}{{model.ArchQwen3, false}, {model.ArchQwen2, true}, {model.ArchLlama, false}, {model.ArchQwen3MoE, false}} {
		for _, onGrid := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/tied=%v/bf16grid=%v", c.arch, c.tied, onGrid), func(t *testing.T) {
				cfg := tinyConfig(c.arch, c.tied)
				if c.arch == model.ArchQwen3MoE {
					// Experts as model.layers.N.mlp.experts.E.*_proj,
					// routers as mlp.gate: what infer.Load reads.
					cfg = tinyMoEConfig(c.tied, 1)
				}
				s, _ := NewStudent(cfg)
				if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 4, Std: 0.3, Perturb: true})); err != nil {
					t.Fatal(err)
				}
				round := func() {
					for i, v := range s.Params {
						s.Params[i] = compute.BF16ToF32(compute.F32ToBF16(v))
					}
				}
				if onGrid {
					round()
				}
				dir := t.TempDir()
				if err := s.WriteHF(dir, "BF16"); err != nil {
					t.Fatal(err)
				}
				tm, err := infer.Load(dir, device.CPU(0))
				if err != nil {
					t.Fatal(err)
				}
				b := testBatch(7, cfg.VocabSize, 4)
				unrounded, err := s.LogProbs(b)
				if err != nil {
					t.Fatal(err)
				}
				round()
				want, err := s.LogProbs(b)
				if err != nil {
					t.Fatal(err)
				}
				V := cfg.VocabSize
				var samples [][]int32
				for q := 0; q+1 < len(b.Starts); q++ {
					samples = append(samples, b.Tokens[b.Starts[q]:b.Starts[q+1]])
				}
				res, err := tm.TopK(samples, infer.Options{K: V})
				if err != nil {
					t.Fatal(err)
				}
				var worst, worstRaw float64
				for q, r := range res {
					for p := 0; p < len(samples[q]); p++ {
						row := int(b.Starts[q]) + p
						for j := 0; j < V; j++ {
							id := r.IDs[p*V+j]
							worst = max(worst, math.Abs(float64(r.LogProbs[p*V+j]-want[row*V+int(id)])))
							worstRaw = max(worstRaw, math.Abs(float64(r.LogProbs[p*V+j]-unrounded[row*V+int(id)])))
						}
					}
				}
				if worst > 2e-4 {
					t.Fatalf("teacher forward of the export vs trainer log-probs (BF16 weights): max |diff| %g > 2e-4", worst)
				}
				if !onGrid && worstRaw < 1e-3 {
					t.Fatalf("max |diff| to the fp32 trainer %g: off-grid weights should show BF16 rounding", worstRaw)
				}
			})
		}
	}
}

// e4m3 decodes an FP8 E4M3 (OCP "fn": bias 7, no infinities, 0x7f/0xff
// NaN) from its bits, independently of package nvfp4.
func e4m3(b uint8) float64 {
	sign := 1.0
	if b&0x80 != 0 {
		sign = -1
	}
	e, m := int(b>>3&15), float64(b&7)
	if e == 0 {
		return sign * m / 8 * math.Pow(2, -6)
	}
	return sign * (1 + m/8) * math.Pow(2, float64(e-7))
}

// e2m1 decodes a 4-bit E2M1 code: sign bit 3, exponent bits 2..1 (bias 1),
// mantissa bit 0; exponent 0 is subnormal (0 or 0.5).
func e2m1(c uint8) float64 {
	sign := 1.0
	if c&8 != 0 {
		sign = -1
	}
	e, m := int(c>>1&3), float64(c&1)
	if e == 0 {
		return sign * m * 0.5
	}
	return sign * (1 + m/2) * math.Pow(2, float64(e-1))
}

// TestExportNVFP4: the Model-Optimizer layout decoded from its bytes with
// the decoders above (written from the OCP FP8 and E2M1 bit layouts)
// reproduces the fake-quantized training weights exactly; scales, dtypes,
// shapes and the quantization configs are as ModelOpt writes them.
func TestExportNVFP4(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3, false)
	s, _ := NewStudent(cfg)
	if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 2, Std: 0.2, Perturb: true})); err != nil {
		t.Fatal(err)
	}
	if err := s.EnableQAD(); err != nil {
		t.Fatal(err)
	}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1}
	b := testBatch(3, cfg.VocabSize, 4)
	if _, err := s.Forward(b, &opt); err != nil {
		t.Fatal(err)
	}
	if err := s.FinishCalibration(); err != nil {
		t.Fatal(err)
	}
	// Move the weights past calibration, as training does.
	for i := range s.Params {
		s.Params[i] *= 1.01
	}
	dir := t.TempDir()
	if err := s.WriteNVFP4(dir); err != nil {
		t.Fatal(err)
	}
	s.Model.QuantizeWeights()
	w, err := model.OpenWeights(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	nq := 0
	for i := range s.Model.Blocks {
		L := &s.Model.Blocks[i]
		a, f := &L.Attn, L.MLP
		inAmax := map[*decoder.Linear]float32{&a.Q: L.InQKV.Amax, &a.K: L.InQKV.Amax, &a.V: L.InQKV.Amax, &a.O: L.InO.Amax, &f.Gate: L.InGateUp.Amax, &f.Up: L.InGateUp.Amax, &f.Down: L.InDown.Amax}
		for _, l := range L.Linears() {
			wfq, err := s.host(l.Wfq)
			if err != nil {
				t.Fatal(err)
			}
			raw, info, err := w.Raw(l.Name + ".weight")
			if err != nil || info.DType != "U8" || info.Shape[0] != l.Out || info.Shape[1] != l.In/2 {
				t.Fatalf("%s.weight: %v %+v", l.Name, err, info)
			}
			sc, sinfo, err := w.Raw(l.Name + ".weight_scale")
			if err != nil || sinfo.DType != "F8_E4M3" || sinfo.Shape[0] != l.Out || sinfo.Shape[1] != l.In/16 {
				t.Fatalf("%s.weight_scale: %v %+v", l.Name, err, sinfo)
			}
			g2raw, g2info, err := w.Raw(l.Name + ".weight_scale_2")
			if err != nil || g2info.DType != "F32" || len(g2info.Shape) != 0 {
				t.Fatalf("%s.weight_scale_2: %v %+v", l.Name, err, g2info)
			}
			g2 := math.Float32frombits(binary.LittleEndian.Uint32(g2raw))
			if g2 != l.WQ.Amax/(6*448) {
				t.Fatalf("%s weight_scale_2 %g, want amax/2688 = %g", l.Name, g2, l.WQ.Amax/2688)
			}
			inraw, _, err := w.Raw(l.Name + ".input_scale")
			if err != nil {
				t.Fatal(err)
			}
			if in := math.Float32frombits(binary.LittleEndian.Uint32(inraw)); in != inAmax[l]/(6*448) {
				t.Fatalf("%s input_scale %g, want %g", l.Name, in, inAmax[l]/2688)
			}
			for r := 0; r < l.Out; r++ {
				for c := 0; c < l.In; c++ {
					byt := raw[(r*l.In+c)/2]
					code := byt & 15 // even element: low nibble
					if c%2 == 1 {
						code = byt >> 4
					}
					scale := float32(e4m3(sc[r*(l.In/16)+c/16])) * g2 // fp32 product, as ModelOpt's dequantize
					got := float32(e2m1(code)) * scale
					if want := wfq[r*l.In+c]; got != want && !(got == 0 && want == 0) {
						t.Fatalf("%s[%d,%d]: export decodes to %g, training used %g", l.Name, r, c, got, want)
					}
				}
			}
			nq++
		}
	}
	if nq != 7*cfg.Layers {
		t.Fatalf("%d quantized linears", nq)
	}
	for _, name := range []string{"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.self_attn.q_norm.weight"} {
		if _, info, err := w.Raw(name); err != nil || info.DType != "BF16" {
			t.Fatalf("%s should stay BF16: %v %+v", name, err, info)
		}
	}
	var hq struct {
		Producer     struct{ Name string }
		Quantization struct {
			QuantAlgo      string   `json:"quant_algo"`
			GroupSize      int      `json:"group_size"`
			ExcludeModules []string `json:"exclude_modules"`
		}
	}
	hb, _ := os.ReadFile(filepath.Join(dir, "hf_quant_config.json"))
	if err := json.Unmarshal(hb, &hq); err != nil || hq.Producer.Name != "modelopt" || hq.Quantization.QuantAlgo != "NVFP4" || hq.Quantization.GroupSize != 16 || len(hq.Quantization.ExcludeModules) != 1 || hq.Quantization.ExcludeModules[0] != "lm_head" {
		t.Fatalf("hf_quant_config.json: %v %s", err, hb)
	}
	var cj struct {
		ModelType string `json:"model_type"`
		QC        struct {
			QuantMethod string `json:"quant_method"`
			QuantAlgo   string `json:"quant_algo"`
		} `json:"quantization_config"`
	}
	cb, _ := os.ReadFile(filepath.Join(dir, "config.json"))
	if err := json.Unmarshal(cb, &cj); err != nil || cj.ModelType != "qwen3" || cj.QC.QuantMethod != "modelopt" || cj.QC.QuantAlgo != "NVFP4" {
		t.Fatalf("config.json: %v %s", err, cb)
	}
	// The config.json still parses as the model's config.
	if _, err := model.LoadConfig(dir); err != nil {
		t.Fatalf("config.json with quantization_config: %v", err)
	}
}

// TestQADStateRoundTrip: RestoreQAD with QuantAmax's values gives the same
// forward as the calibrated student (resume of a QAD run).
func TestQADStateRoundTrip(t *testing.T) {
	cfg := tinyConfig(model.ArchLlama, false)
	s, _ := NewStudent(cfg)
	w := model.Init(cfg, model.InitOptions{Seed: 5, Std: 0.2})
	s.Load(w)
	s.EnableQAD()
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Renormalize, Temperature: 1, KDWeight: 1, SFTWeight: 1}
	b := testBatch(1, cfg.VocabSize, 4)
	s.Forward(b, &opt)
	if err := s.FinishCalibration(); err != nil {
		t.Fatal(err)
	}
	amax := s.QuantAmax()
	want, _ := s.Forward(b, &opt)
	r, _ := NewStudent(cfg)
	r.Load(w)
	if err := r.RestoreQAD(amax); err != nil {
		t.Fatal(err)
	}
	got, _ := r.Forward(b, &opt)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("restored QAD forward %+v, calibrated %+v", got, want)
	}
	plain, _ := NewStudent(cfg)
	plain.Load(w)
	if p, _ := plain.Forward(b, &opt); p.Loss == want.Loss {
		t.Fatal("QAD forward equals the unquantized one: the check is vacuous")
	}
	if err := r.RestoreQAD(amax[:5]); err == nil {
		t.Fatal("short amax list accepted")
	}
}

// TestNVFP4FusedShardsShareScale2: serving engines (vLLM, SGLang,
// TensorRT-LLM) fuse q/k/v and gate/up into one GEMM with ONE global scale,
// the max of the shards' weight_scale_2 (and input_scale); ModelOpt's export
// therefore unifies the weight amax of those shards (preprocess_linear_fusion).
// A shard exported with its own, smaller weight_scale_2 would be decoded
// with the max and come out scaled wrong.
func TestNVFP4FusedShardsShareScale2(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3, false)
	s, _ := NewStudent(cfg)
	if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 2, Std: 0.2, Perturb: true})); err != nil {
		t.Fatal(err)
	}
	// Make the shards' max |w| differ.
	w := s.Weights()
	for i := range cfg.Layers {
		p := fmt.Sprintf("model.layers.%d.", i)
		w[p+"self_attn.k_proj.weight"][0], w[p+"mlp.up_proj.weight"][0] = 3, 5
	}
	if err := s.EnableQAD(); err != nil {
		t.Fatal(err)
	}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1}
	if _, err := s.Forward(testBatch(3, cfg.VocabSize, 4), &opt); err != nil {
		t.Fatal(err)
	}
	if err := s.FinishCalibration(); err != nil {
		t.Fatal(err)
	}
	packed, in, err := s.ExportNVFP4()
	if err != nil {
		t.Fatal(err)
	}
	for i := range cfg.Layers {
		p := fmt.Sprintf("model.layers.%d.", i)
		for _, group := range [][]string{{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, {"mlp.gate_proj", "mlp.up_proj"}} {
			g2, is := packed[p+group[0]].WeightScale2, in[p+group[0]]
			for _, n := range group[1:] {
				if packed[p+n].WeightScale2 != g2 || in[p+n] != is {
					t.Fatalf("%s%s: weight_scale_2 %g input_scale %g, but %s has %g, %g: fused shards need one scale",
						p, n, packed[p+n].WeightScale2, in[p+n], group[0], g2, is)
				}
			}
		}
	}
}

// TestQuantLayout: decoder.QuantLayout, from the config alone, names the
// quantized Linears of a built model in order, with their shapes and the
// QuantAmax indices of their weight and input quantizers (amax i+1 at
// index i, so an index is checked by the value the model holds), for
// dense students of each architecture and an MoE student with a dense
// layer among its sparse ones.
func TestQuantLayout(t *testing.T) {
	for _, cfg := range []*model.Config{tinyConfig(model.ArchQwen3, false), tinyConfig(model.ArchQwen2, true), tinyConfig(model.ArchLlama, false), tinyMoEConfig(false, 1)} {
		t.Run(string(cfg.Arch), func(t *testing.T) {
			s, err := NewStudent(cfg)
			if err != nil {
				t.Fatal(err)
			}
			n := len(decoder.QuantLayout(cfg)) + 4*cfg.Layers
			amax := make([]float32, n)
			for i := range amax {
				amax[i] = float32(i + 1)
			}
			if err := s.RestoreQAD(amax); err != nil {
				t.Fatalf("RestoreQAD with the layout's %d values: %v", n, err)
			}
			var got []decoder.QuantLinear
			for i := range s.Model.Blocks {
				L := &s.Model.Blocks[i]
				in := map[*decoder.Linear]float32{&L.Attn.Q: L.InQKV.Amax, &L.Attn.K: L.InQKV.Amax, &L.Attn.V: L.InQKV.Amax, &L.Attn.O: L.InO.Amax}
				var mlps []*decoder.MLP
				if L.MLP != nil {
					mlps = append(mlps, L.MLP)
				}
				for e := range L.Experts {
					mlps = append(mlps, &L.Experts[e])
				}
				for _, f := range mlps {
					in[&f.Gate], in[&f.Up], in[&f.Down] = L.InGateUp.Amax, L.InGateUp.Amax, L.InDown.Amax
				}
				for _, l := range L.Linears() {
					got = append(got, decoder.QuantLinear{Name: l.Name, Out: l.Out, In: l.In, W: int(l.WQ.Amax) - 1, Input: int(in[l]) - 1})
				}
			}
			if want := decoder.QuantLayout(cfg); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("the model's quantized Linears\n%v\nthe layout\n%v", got, want)
			}
		})
	}
}
