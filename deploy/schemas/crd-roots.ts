// The root types that deploy/schemas/README.md generates the custom resources' JSON schemas from:
// each package's own root interface extends a TypeMeta that ts-json-schema-generator cannot resolve,
// so each is restated here with its apiVersion, kind, metadata and the package's spec type.
import { IIoK8sApimachineryPkgApisMetaV1ObjectMeta as ObjectMeta } from "@kubernetes-models/apimachinery/apis/meta/v1/ObjectMeta";
import { IScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { IServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { IPrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

export interface ScaledObject {
  apiVersion: "keda.sh/v1alpha1";
  kind: "ScaledObject";
  metadata?: ObjectMeta;
  spec: IScaledObject["spec"];
}

export interface ServiceMonitor {
  apiVersion: "monitoring.coreos.com/v1";
  kind: "ServiceMonitor";
  metadata?: ObjectMeta;
  spec: IServiceMonitor["spec"];
}

export interface PrometheusRule {
  apiVersion: "monitoring.coreos.com/v1";
  kind: "PrometheusRule";
  metadata?: ObjectMeta;
  spec: IPrometheusRule["spec"];
}
