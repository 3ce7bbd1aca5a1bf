package computetest

import "distill/compute/ref"

// The float64 oracles, by the names the checks use.
var (
	linear       = ref.Linear
	embedding    = ref.Embedding
	rmsNorm      = ref.RMSNorm
	rope         = ref.Rope
	attention    = ref.Attention
	attentionLSE = ref.AttentionLSE
	swiGLU       = ref.SwiGLU
	dot          = ref.Dot
	logSumExp    = ref.LogSumExp
)

// gradFD is the central finite-difference gradient of f w.r.t. all of x.
func gradFD(f func() float64, x []float64, h float64) []float64 { return ref.Grad(f, x, nil, h) }

// gradFDAt is gradFD at the elements idx of x.
func gradFDAt(f func() float64, x []float64, idx []int, h float64) []float64 {
	return ref.Grad(f, x, idx, h)
}
